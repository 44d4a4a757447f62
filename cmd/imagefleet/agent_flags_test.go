package main

import (
	"strings"
	"testing"

	"github.com/spf13/pflag"

	"github.com/imagefleet/imagefleet/services/fleet"
)

// TestNodeStatusReportFrequencyFlag: --node-status-report-frequency (the kubelet's nodeStatusReportFrequency,
// default 5m) becomes the heartbeat's FullEvery in whole periods, rounded up; 0 or negative is refused with
// the flag's name.
func TestNodeStatusReportFrequencyFlag(t *testing.T) {
	for _, tc := range []struct {
		name      string
		args      []string
		fullEvery int
		err       string
	}{
		{"defaults: 5m at 10s", nil, 30, ""},
		{"one minute", []string{"--node-status-report-frequency", "1m"}, 6, ""},
		{"rounded up", []string{"--node-status-report-frequency", "25s"}, 3, ""},
		{"below the period: every heartbeat", []string{"--node-status-report-frequency", "5s"}, 1, ""},
		{"longer period", []string{"--heartbeat-period", "30s"}, 10, ""},
		{"period defaulted", []string{"--heartbeat-period", "0s", "--node-status-report-frequency", "20s"}, 2, ""},
		{"a year", []string{"--node-status-report-frequency", "8760h"}, 3153600, ""},
		{"zero", []string{"--node-status-report-frequency", "0s"}, 0,
			"invalid configuration: nodeStatusReportFrequency (--node-status-report-frequency) 0s: must be above 0"},
		{"negative", []string{"--node-status-report-frequency", "-1m"}, 0,
			"invalid configuration: nodeStatusReportFrequency (--node-status-report-frequency) -1m0s: must be above 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := agentHeartbeatConfig(t, tc.args...)
			if tc.err != "" {
				if err == nil || err.Error() != tc.err {
					t.Fatalf("error %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cfg.FullEvery != tc.fullEvery || cfg.Node != "n1" {
				t.Fatalf("FullEvery %d (node %q), want %d", cfg.FullEvery, cfg.Node, tc.fullEvery)
			}
		})
	}
	t.Run("hollow", func(t *testing.T) {
		h, _, err := parseHollow(t, "--nodes", "1", "--node-status-report-frequency", "2m")
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := heartbeatConfig(&h.Agent, &agentEnv{Node: "hollow-0"})
		if err != nil || cfg.FullEvery != 12 {
			t.Fatalf("FullEvery %d, %v; want 12", cfg.FullEvery, err)
		}
	})
	t.Run("usage names the kubelet's setting", func(t *testing.T) {
		var c agentConfig
		fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
		c.flags(fs)
		if f := fs.Lookup("node-status-report-frequency"); f == nil || f.DefValue != "5m0s" || !strings.Contains(f.Usage, "nodeStatusReportFrequency") {
			t.Fatalf("flag %+v", f)
		}
	})
}

// TestHeartbeatMaxRateFlag: --heartbeat-max-rate (default 500) becomes the heartbeat's MaxRate; 0 keeps the
// period fixed (HeartbeatConfig's negative); a negative value is refused with the flag's name; hollow
// agents take it too.
func TestHeartbeatMaxRateFlag(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want float64
		err  string
	}{
		{"default", nil, 500, ""},
		{"set", []string{"--heartbeat-max-rate", "2000"}, 2000, ""},
		{"fractional", []string{"--heartbeat-max-rate", "0.5"}, 0.5, ""},
		{"zero: fixed period", []string{"--heartbeat-max-rate", "0"}, -1, ""},
		{"negative", []string{"--heartbeat-max-rate", "-3"}, 0,
			"invalid configuration: --heartbeat-max-rate -3: must not be negative (0 keeps the period fixed)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := agentHeartbeatConfig(t, tc.args...)
			if tc.err != "" {
				if err == nil || err.Error() != tc.err {
					t.Fatalf("error %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || cfg.MaxRate != tc.want {
				t.Fatalf("MaxRate %v, %v; want %v", cfg.MaxRate, err, tc.want)
			}
		})
	}
	t.Run("hollow", func(t *testing.T) {
		h, _, err := parseHollow(t, "--nodes", "1", "--heartbeat-max-rate", "50")
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := heartbeatConfig(&h.Agent, &agentEnv{Node: "hollow-0"})
		if err != nil || cfg.MaxRate != 50 {
			t.Fatalf("MaxRate %v, %v; want 50", cfg.MaxRate, err)
		}
	})
}

// agentHeartbeatConfig parses args as the agent's flags and builds node n1's heartbeat config from them.
func agentHeartbeatConfig(t *testing.T, args ...string) (fleet.HeartbeatConfig, error) {
	t.Helper()
	var c agentConfig
	fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	c.flags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return heartbeatConfig(&c, &agentEnv{Node: "n1", Workers: []string{"heartbeat"}})
}
