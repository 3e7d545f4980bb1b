package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/urfave/cli/v2"

	"meshgpu/node"
)

// health is the container healthcheck: the runtime image has no curl.
func init() {
	register(&cli.Command{
		Name:  "health",
		Usage: "exit 0 when a meshgpu server answers GET /health with 200",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "url", Value: "http://" + node.DefaultListen + "/health", Usage: "health URL", EnvVars: cmdEnvVars("health", "url")},
			&cli.DurationFlag{Name: "timeout", Value: 5 * time.Second, Usage: "give up after", EnvVars: cmdEnvVars("health", "timeout")},
		},
		Action: func(c *cli.Context) error {
			ctx, cancel := context.WithTimeout(c.Context, c.Duration("timeout"))
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.String("url"), nil)
			if err != nil {
				return fmt.Errorf("--url: %w", err)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return fmt.Errorf("health: %w", err)
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("health: %s answered %s", c.String("url"), resp.Status)
			}
			fmt.Fprintln(c.App.Writer, string(body))
			return nil
		},
	})
}
