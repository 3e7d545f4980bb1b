// Package dockerlint lints the Dockerfiles (Dockerfile: the CPU image,
// Dockerfile.cuda: the CUDA image) without a Docker engine: BuildKit's own
// parser and linter (the rules `docker build --check` applies), plus the
// project's rules: non-root runtime user, healthcheck, data volume, build
// steps that are make targets CI also runs, COPY sources that exist, base
// images named by build args (scripts/docker-bases.sh makes local stand-ins),
// and no CUDA in the CPU image. `make docker-test` builds and runs them.
//
// It is its own module (tools/dockerlint/go.mod) so BuildKit and its
// dependencies stay out of the product's go.mod; .ci/run runs it.
package dockerlint

import (
	"fmt"
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

// dockerfiles are the Dockerfiles and the stages each must have at least.
var dockerfiles = map[string]int{
	"Dockerfile":      2, // Go, runtime
	"Dockerfile.cuda": 3, // Go, CUDA library, runtime
}

// lint returns every problem found in the Dockerfile text; minStages is
// how many stages it must have.
func lint(t *testing.T, text, root string, minStages int) []string {
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
	if len(stages) < minStages {
		return append(problems, fmt.Sprintf("want a multi-stage build of %d stages at least, not %d", minStages, len(stages)))
	}
	if minStages < 3 && regexp.MustCompile(`(?i)cuda`).MatchString(stripComments(text)) {
		problems = append(problems, "the CPU image names CUDA: it must have no CUDA layers")
	}
	// A base is an earlier stage or a build arg with a default (the
	// official image), so local stand-ins can replace it.
	named := map[string]bool{}
	for _, st := range stages {
		if !named[strings.ToLower(st.BaseName)] && !regexp.MustCompile(`^\$\{?[A-Z_]+_IMAGE\}?$`).MatchString(st.BaseName) {
			problems = append(problems, "FROM "+st.BaseName+": name the base image with a build arg (ARG ..._IMAGE=default)")
		}
		if st.Name != "" {
			named[strings.ToLower(st.Name)] = true
		}
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

// stripComments drops the comment lines, which may mention anything.
func stripComments(text string) string {
	return regexp.MustCompile(`(?m)^\s*#.*$`).ReplaceAllString(text, "")
}

func TestDockerfiles(t *testing.T) {
	root := repoRoot()
	for name, minStages := range dockerfiles {
		data, err := os.ReadFile(filepath.Join(root, name))
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range lint(t, string(data), root, minStages) {
			t.Errorf("%s: %s", name, p)
		}
	}
}

// The linter must be able to fail: each broken file trips its rule.
func TestLintCatchesProblems(t *testing.T) {
	root := repoRoot()
	good, err := os.ReadFile(filepath.Join(root, "Dockerfile.cuda"))
	if err != nil {
		t.Fatal(err)
	}
	cpu, err := os.ReadFile(filepath.Join(root, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	cases := map[string]string{
		"FromAsCasing":     strings.Replace(string(good), " AS go-build", " as go-build", 1),
		"non-root":         strings.Replace(string(good), "USER meshgpu", "USER root", 1),
		"HEALTHCHECK":      regexp.MustCompile(`(?s)HEALTHCHECK.*?\]\n`).ReplaceAllString(string(good), ""),
		"VOLUME":           strings.Replace(string(good), `VOLUME ["/data"]`, "", 1),
		"no such Makefile": strings.Replace(string(good), "make build BIN", "make build-everything BIN", 1),
		"not in the repo":  strings.Replace(string(good), "COPY kernels/ kernels/", "COPY kernelz/ kernels/", 1),
		"build arg":        strings.Replace(string(good), "FROM ${CUDA_RUNTIME_IMAGE}", "FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04", 1),
		"multi-stage":      regexp.MustCompile(`(?s)# --- CUDA library ---.*?# --- runtime ---`).ReplaceAllString(string(good), ""),
	}
	cpuCases := map[string]string{
		"no CUDA layers": strings.Replace(string(cpu), "FROM ${RUNTIME_IMAGE}", "FROM ${RUNTIME_IMAGE}\nENV MESHGPU_CUDA_LIB=/x", 1),
	}
	for want, text := range cases {
		check(t, want, text, string(good), root, dockerfiles["Dockerfile.cuda"])
	}
	for want, text := range cpuCases {
		check(t, want, text, string(cpu), root, dockerfiles["Dockerfile"])
	}
}

// check lints text, good broken one way, and wants a problem naming want.
func check(t *testing.T, want, text, good, root string, minStages int) {
	t.Helper()
	if text == good {
		t.Fatalf("case %q did not change the Dockerfile", want)
	}
	problems := lint(t, text, root, minStages)
	if !strings.Contains(strings.Join(problems, "\n"), want) {
		t.Errorf("breaking %q: problems %q do not mention it", want, problems)
	}
}
