package tracker

import (
	"strings"
	"testing"

	"meshgpu/internal/testenv"
)

// Each refused address range is refused for its own reason: a registrant
// naming a multicast group is not told it named the cloud metadata service
// (224.0.0.1 used to be "link-local (where cloud metadata services live)").
func TestRegistrationRefusalReasons(t *testing.T) {
	testenv.CheckGoroutines(t)
	_, ts := startStrictTracker(t, Config{})
	for ep, reason := range map[string]string{
		"http://169.254.169.254/latest": "link-local (where cloud metadata services live)",
		"http://[fe80::1]:80":           "link-local (where cloud metadata services live)",
		"http://224.0.0.1:7001":         "link-local multicast",
		"http://[ff02::1]:7001":         "link-local multicast",
		"http://239.1.2.3:7001":         "is a multicast address",
		"http://[ff0e::1]:7001":         "is a multicast address",
		"http://255.255.255.255:7001":   "the broadcast address",
		"http://0.0.0.0:7001":           "the unspecified address",
	} {
		err := registerAs(t, ts.URL, newIdentity(t), reg(ep, 0, 5, 6, 1))
		if statusOf(err) != 400 || !strings.Contains(err.Error(), reason) {
			t.Errorf("endpoint %s: %v, want 400 saying %q", ep, err, reason)
		}
		if reason != "link-local (where cloud metadata services live)" && strings.Contains(err.Error(), "metadata") {
			t.Errorf("endpoint %s is refused as the metadata range: %v", ep, err)
		}
	}
}
