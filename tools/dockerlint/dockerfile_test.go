// Package dockerlint lints Dockerfile.cuda without a Docker engine: BuildKit's
// own parser and linter (the rules `docker build --check` applies), plus the
// project's rules: non-root runtime user, healthcheck, model volume, build
// steps that are make targets CI also runs, and COPY sources that exist.
//
// It is its own module (tools/dockerlint/go.mod) so BuildKit and its
// dependencies stay out of the product's go.mod; .ci/run runs it.
package dockerlint

import (
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/linter"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
)

// lint returns every problem found in the Dockerfile text.
func lint(t *testing.T, text, root string) []string {
	t.Helper()
	var problems []string
	res, err := parser.Parse(strings.NewReader(text))
	if err != nil {
		return []string{"parse: " + err.Error()}
	}
	for _, w := range res.Warnings {
		problems = append(problems, "parser: "+w.Short)
	}
	l := linter.New(&linter.Config{Warn: func(rule, _, _, msg string, _ []parser.Range) {
		problems = append(problems, rule+": "+msg)
	}})
	stages, _, err := instructions.Parse(res.AST, l)
	if err != nil {
		return append(problems, "instructions: "+err.Error())
	}
	if len(stages) < 3 {
		problems = append(problems, "want a multi-stage build (Go, CUDA library, runtime)")
		return problems
	}
	final := stages[len(stages)-1]
	var user string
	var health, volume bool
	for _, cmd := range final.Commands {
		switch c := cmd.(type) {
		case *instructions.UserCommand:
			user = c.User
		case *instructions.HealthCheckCommand:
			health = true
		case *instructions.VolumeCommand:
			volume = true
		}
	}
	if user == "" || user == "root" || user == "0" {
		problems = append(problems, "the runtime stage must run as a non-root USER")
	}
	if !health {
		problems = append(problems, "the runtime stage needs a HEALTHCHECK")
	}
	if !volume {
		problems = append(problems, "the runtime stage needs a VOLUME for the model cache")
	}
	makefile, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		return append(problems, err.Error())
	}
	makeRun := regexp.MustCompile(`\bmake\s+([a-z][a-z0-9-]*)`)
	for _, st := range stages {
		for _, cmd := range st.Commands {
			switch c := cmd.(type) {
			case *instructions.RunCommand:
				for _, m := range makeRun.FindAllStringSubmatch(strings.Join(c.CmdLine, " "), -1) {
					if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(m[1]) + `:`).Match(makefile) {
						problems = append(problems, "RUN make "+m[1]+": no such Makefile target")
					}
				}
			case *instructions.CopyCommand:
				if c.From != "" {
					continue
				}
				for _, src := range c.SourcePaths {
					if src == "." {
						continue
					}
					if _, err := os.Stat(filepath.Join(root, src)); err != nil {
						problems = append(problems, "COPY "+src+": not in the repository")
					}
				}
			}
		}
	}
	return problems
}

// repoRoot is the product's checkout, two folders above this module.
func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

func TestDockerfileCUDA(t *testing.T) {
	root := repoRoot()
	data, err := os.ReadFile(filepath.Join(root, "Dockerfile.cuda"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range lint(t, string(data), root) {
		t.Error(p)
	}
}

// The linter must be able to fail: each broken file trips its rule.
func TestLintCatchesProblems(t *testing.T) {
	root := repoRoot()
	good, err := os.ReadFile(filepath.Join(root, "Dockerfile.cuda"))
	if err != nil {
		t.Fatal(err)
	}
	cases := map[string]string{
		"FromAsCasing":     strings.Replace(string(good), " AS go-build", " as go-build", 1),
		"non-root":         strings.Replace(string(good), "USER meshgpu", "USER root", 1),
		"HEALTHCHECK":      regexp.MustCompile(`(?s)HEALTHCHECK.*?\]\n`).ReplaceAllString(string(good), ""),
		"no such Makefile": strings.Replace(string(good), "RUN make build", "RUN make build-everything", 1),
		"not in the repo":  strings.Replace(string(good), "COPY kernels/ kernels/", "COPY kernelz/ kernels/", 1),
	}
	for want, text := range cases {
		if text == string(good) {
			t.Fatalf("case %q did not change the Dockerfile", want)
		}
		problems := lint(t, text, root)
		if !strings.Contains(strings.Join(problems, "\n"), want) {
			t.Errorf("breaking %q: problems %q do not mention it", want, problems)
		}
	}
}
