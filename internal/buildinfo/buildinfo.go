// Package buildinfo says which meshgpu this is, for --version and the
// build_info metric of every server.
package buildinfo

import (
	"errors"
	"runtime"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Version is set at link time (go build -ldflags "-X
// meshgpu/internal/buildinfo.Version=v1.2.3"); when empty, the module
// version or VCS revision recorded by the Go toolchain is used.
var Version string

// Info is what a binary knows about its build.
type Info struct {
	Version   string // ldflags, else module version, else "devel"
	Revision  string // VCS commit, "" when not built from a checkout
	Modified  bool   // the checkout had uncommitted changes
	GoVersion string
}

// Get reads the build information.
func Get() Info {
	in := Info{Version: Version, GoVersion: runtime.Version()}
	bi, ok := debug.ReadBuildInfo()
	if ok {
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				in.Revision = s.Value
			case "vcs.modified":
				in.Modified = s.Value == "true"
			}
		}
		if in.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			in.Version = bi.Main.Version
		}
	}
	if in.Version == "" {
		in.Version = "devel"
	}
	return in
}

// String is the one line of --version.
func (in Info) String() string {
	s := "meshgpu " + in.Version
	if in.Revision != "" {
		r := in.Revision
		if len(r) > 12 {
			r = r[:12]
		}
		s += " (" + r
		if in.Modified {
			s += ", modified"
		}
		s += ")"
	}
	return s + " " + in.GoVersion + " " + runtime.GOOS + "/" + runtime.GOARCH
}

// Register adds the go_* and process_* collectors and a
// <namespace>_build_info gauge (1, labelled with the version) to reg. A
// registry that already has them (servers sharing one) is left as is.
func Register(reg prometheus.Registerer, namespace string) {
	in := Get()
	bi := prometheus.NewGauge(prometheus.GaugeOpts{Name: namespace + "_build_info",
		Help:        "Always 1; the labels say which build is running.",
		ConstLabels: prometheus.Labels{"version": in.Version, "revision": in.Revision, "goversion": in.GoVersion}})
	bi.Set(1)
	for _, c := range []prometheus.Collector{collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), bi} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				panic(err)
			}
		}
	}
}
