package main

import (
	"fmt"

	"github.com/urfave/cli/v2"

	"meshgpu/internal/apiauth"
)

// apiAuthFlags guard the OpenAI endpoints of `run` (a head) and `tracker`
// alike; the names are shared (MESHGPU_API_KEY...), one deployment's keys.
func apiAuthFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringSliceFlag{Name: "api-key", Usage: "require this key (Authorization: Bearer KEY) on the OpenAI endpoints /v1/... (repeatable or a comma list; none: open)", EnvVars: envVars("api-key")},
		&cli.StringFlag{Name: "api-key-file", Usage: "file of API keys, one per line (# comments), added to --api-key", EnvVars: envVars("api-key-file")},
		&cli.StringSliceFlag{Name: "allowed-origins", Usage: "browser origins allowed to call /v1/... cross-origin (CORS), e.g. http://localhost:3000, or *", EnvVars: envVars("allowed-origins")},
	}
}

func apiAuthConfig(c *cli.Context) (apiauth.Config, error) {
	keys, err := apiauth.LoadKeys(c.StringSlice("api-key"), c.String("api-key-file"))
	if err != nil {
		return apiauth.Config{}, fmt.Errorf("--api-key/--api-key-file: %w", err)
	}
	origins := c.StringSlice("allowed-origins")
	if err := apiauth.CheckOrigins(origins); err != nil {
		return apiauth.Config{}, fmt.Errorf("--allowed-origins: %w", err)
	}
	return apiauth.Config{Keys: keys, AllowedOrigins: origins}, nil
}
