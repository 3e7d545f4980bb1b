package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"testing"
)

// TestMainHelperProcess is main() inside a child process (this test binary
// re-entered by meshgpuCmd), so exit codes, stderr and signals are real.
func TestMainHelperProcess(t *testing.T) {
	js := os.Getenv("MESHGPU_TEST_MAIN_ARGS")
	if js == "" {
		t.Skip("helper process for the CLI tests")
	}
	var args []string
	if err := json.Unmarshal([]byte(js), &args); err != nil {
		os.Exit(3)
	}
	os.Args = append([]string{"meshgpu"}, args...)
	main()
	os.Exit(0)
}

// meshgpuCmd is `meshgpu args...` as a child process; env is added to the
// child's environment.
func meshgpuCmd(env []string, args ...string) *exec.Cmd {
	js, _ := json.Marshal(args)
	cmd := exec.Command(os.Args[0], "-test.run=^TestMainHelperProcess$")
	cmd.Env = append(append(os.Environ(), "MESHGPU_TEST_MAIN_ARGS="+string(js)), env...)
	return cmd
}

// runMeshgpu runs `meshgpu args...` in a child process to its end.
func runMeshgpu(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	cmd := meshgpuCmd(nil, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), errb.String(), code
}
