package main

import (
	"crypto/tls"
	"errors"
	"fmt"

	"github.com/urfave/cli/v2"
)

// apiTLSFlags are --tls-cert and --tls-key of a command that serves the
// OpenAI API (tracker, run), read from MESHGPU_<COMMAND>_TLS_CERT/_KEY.
func apiTLSFlags(command, what string) []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "tls-cert", Usage: "TLS certificate file (PEM, the full chain); with --tls-key " + what, EnvVars: cmdEnvVars(command, "tls-cert")},
		&cli.StringFlag{Name: "tls-key", Usage: "TLS private key file (PEM) of --tls-cert", EnvVars: cmdEnvVars(command, "tls-key")},
	}
}

// apiCertificate loads --tls-cert and --tls-key (nil when neither is set).
func apiCertificate(c *cli.Context) (*tls.Certificate, error) {
	cert, key := c.String("tls-cert"), c.String("tls-key")
	switch {
	case cert == "" && key == "":
		return nil, nil
	case cert == "" || key == "":
		return nil, errors.New("--tls-cert and --tls-key go together; give both or neither")
	}
	pair, err := tls.LoadX509KeyPair(cert, key)
	if err != nil {
		return nil, fmt.Errorf("--tls-cert %s --tls-key %s: %v (want PEM files: the certificate chain and its private key, e.g. certbot's fullchain.pem and privkey.pem)", cert, key, err)
	}
	return &pair, nil
}
