package kubeletcfg

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func settings(ws []Warning) []string {
	var out []string
	for _, w := range ws {
		out = append(out, w.Setting)
	}
	return out
}

func TestDefaults(t *testing.T) {
	c, err := Parse([]byte("apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.ImageGCHighThresholdPercent != 85 || c.ImageGCLowThresholdPercent != 80 || c.ImageMinimumGCAge != 2*time.Minute ||
		c.ImageMaximumGCAge != 0 || c.EvictionHard["imagefs.available"] != "15%" {
		t.Fatalf("defaults %+v", c)
	}
}

func TestCheck(t *testing.T) {
	const head = "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n"
	ours := Ours{HighThresholdPercent: 75, LowThresholdPercent: 70}
	cases := []struct {
		name, yaml, mode string
		ours             Ours
		want             []string
		contains         string
	}{
		{"defaults beside imagefleet at 75/70: eviction at 15% free is below the 25% imagefleet keeps", "", FirstResponder, ours, nil, ""},
		{"defaults beside imagefleet at its own defaults 85/80: eviction first", "", FirstResponder,
			Ours{HighThresholdPercent: 85, LowThresholdPercent: 80}, []string{"imageGCHighThresholdPercent"}, "at or below imagefleet's high threshold 85"},
		{"imagefleet at 90: both fight", "", FirstResponder, Ours{HighThresholdPercent: 90, LowThresholdPercent: 85},
			[]string{"imageGCHighThresholdPercent", "evictionHard[imagefs.available]"}, "set it to at most 10%"},
		{"kubelet GC off in first-responder mode", "imageGCHighThresholdPercent: 100\n", FirstResponder, ours,
			[]string{"imageGCHighThresholdPercent"}, "no backstop"},
		{"kubelet age GC first", "imageMaximumGCAge: 1h\n", FirstResponder, Ours{HighThresholdPercent: 75, MaxAge: 2 * time.Hour},
			[]string{"imageMaximumGCAge"}, "1h0m0s"},
		{"takeover done right", "imageGCHighThresholdPercent: 100\nimageMaximumGCAge: 0s\nevictionHard:\n  imagefs.available: \"0%\"\n", Takeover, ours, nil, ""},
		{"takeover with the kubelet's GC on", "imageMaximumGCAge: 10m\n", Takeover, ours,
			[]string{"imageGCHighThresholdPercent", "imageMaximumGCAge"}, "takeover"},
		{"soft eviction as a quantity over what imagefleet keeps", "evictionSoft:\n  imagefs.available: 3Gi\n", Takeover,
			Ours{HighThresholdPercent: 80, CapacityBytes: 10 << 30}, []string{"imageGCHighThresholdPercent", "evictionSoft[imagefs.available]"}, "3Gi"},
		{"a quantity with the capacity unknown is not judged", "evictionHard:\n  imagefs.available: 3Gi\n", FirstResponder, ours, nil, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			k, err := Parse([]byte(head + c.yaml))
			if err != nil {
				t.Fatal(err)
			}
			ws, err := Check(k, c.mode, c.ours)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(settings(ws), c.want) {
				t.Fatalf("warnings %q, want settings %q", ws, c.want)
			}
			var all []string
			for _, w := range ws {
				all = append(all, w.String())
			}
			if c.contains != "" && !strings.Contains(strings.Join(all, "\n"), c.contains) {
				t.Fatalf("warnings %q do not say %q", all, c.contains)
			}
		})
	}
}

func TestBadInput(t *testing.T) {
	for _, bad := range []string{
		"kind: Pod\napiVersion: v1\n",
		"apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nimageMinimumGCAge: soon\n",
		"{{{",
	} {
		if _, err := Parse([]byte(bad)); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
	k, _ := Parse([]byte("apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nevictionHard:\n  imagefs.available: \"150%\"\n"))
	if _, err := Check(k, FirstResponder, Ours{HighThresholdPercent: 80}); err == nil {
		t.Error("150% accepted")
	}
	if _, err := Check(k, "both", Ours{}); err == nil {
		t.Error("mode both accepted")
	}
	if _, err := Load(filepath.Join(t.TempDir(), "none.yaml")); !os.IsNotExist(unwrapAll(err)) {
		t.Errorf("missing file: %v", err)
	}
}

func unwrapAll(err error) error {
	for {
		u, ok := err.(interface{ Unwrap() error })
		if !ok {
			return err
		}
		err = u.Unwrap()
	}
}
