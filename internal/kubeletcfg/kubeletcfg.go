// Package kubeletcfg reads the image GC and eviction settings of a kubelet's KubeletConfiguration file and
// tells, by the setting's name, where the kubelet and imagefleet would fight over the image filesystem.
package kubeletcfg

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"
)

// Modes of living beside the kubelet (docs/kubernetes.md).
const (
	// FirstResponder: imagefleet's thresholds below the kubelet's; the kubelet's image GC is the backstop.
	FirstResponder = "first-responder"
	// Takeover: the kubelet's image GC off (imageGCHighThresholdPercent 100, imageMaximumGCAge 0), imagefleet
	// alone removes images.
	Takeover = "takeover"
)

// Config is the part of a KubeletConfiguration (kubelet.config.k8s.io/v1beta1) that concerns images, with
// the kubelet's defaults applied.
type Config struct {
	ImageGCHighThresholdPercent int32
	ImageGCLowThresholdPercent  int32
	ImageMinimumGCAge           time.Duration
	ImageMaximumGCAge           time.Duration
	// EvictionHard and EvictionSoft are the eviction thresholds (signal -> "15%" or a quantity). A file
	// that sets evictionHard at all replaces the kubelet's whole default map.
	EvictionHard map[string]string
	EvictionSoft map[string]string
}

// DefaultEvictionHard is the kubelet's default evictionHard (Linux).
var DefaultEvictionHard = map[string]string{
	"memory.available": "100Mi", "nodefs.available": "10%", "nodefs.inodesFree": "5%",
	"imagefs.available": "15%", "imagefs.inodesFree": "5%",
}

type file struct {
	Kind                        string            `json:"kind"`
	APIVersion                  string            `json:"apiVersion"`
	ImageGCHighThresholdPercent *int32            `json:"imageGCHighThresholdPercent"`
	ImageGCLowThresholdPercent  *int32            `json:"imageGCLowThresholdPercent"`
	ImageMinimumGCAge           *string           `json:"imageMinimumGCAge"`
	ImageMaximumGCAge           *string           `json:"imageMaximumGCAge"`
	EvictionHard                map[string]string `json:"evictionHard"`
	EvictionSoft                map[string]string `json:"evictionSoft"`
}

// Load reads a KubeletConfiguration file (YAML or JSON).
func Load(path string) (Config, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("kubelet config: %w", err)
	}
	return Parse(raw)
}

// Parse parses a KubeletConfiguration and applies the kubelet's defaults (85, 80, 2m, 0, the default
// evictionHard).
func Parse(raw []byte) (Config, error) {
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		return Config{}, fmt.Errorf("kubelet config: %w", err)
	}
	var f file
	dec := json.NewDecoder(bytes.NewReader(js))
	if err := dec.Decode(&f); err != nil {
		return Config{}, fmt.Errorf("kubelet config: %w", err)
	}
	if f.Kind != "KubeletConfiguration" || !strings.HasPrefix(f.APIVersion, "kubelet.config.k8s.io/") {
		return Config{}, fmt.Errorf("kubelet config: kind %q apiVersion %q is not a KubeletConfiguration (kubelet.config.k8s.io)", f.Kind, f.APIVersion)
	}
	c := Config{ImageGCHighThresholdPercent: 85, ImageGCLowThresholdPercent: 80, ImageMinimumGCAge: 2 * time.Minute,
		EvictionHard: DefaultEvictionHard, EvictionSoft: f.EvictionSoft}
	if f.ImageGCHighThresholdPercent != nil {
		c.ImageGCHighThresholdPercent = *f.ImageGCHighThresholdPercent
	}
	if f.ImageGCLowThresholdPercent != nil {
		c.ImageGCLowThresholdPercent = *f.ImageGCLowThresholdPercent
	}
	for _, d := range []struct {
		name string
		in   *string
		out  *time.Duration
	}{{"imageMinimumGCAge", f.ImageMinimumGCAge, &c.ImageMinimumGCAge}, {"imageMaximumGCAge", f.ImageMaximumGCAge, &c.ImageMaximumGCAge}} {
		if d.in == nil {
			continue
		}
		v, err := time.ParseDuration(*d.in)
		if err != nil {
			return Config{}, fmt.Errorf("kubelet config: %s %q: %w", d.name, *d.in, err)
		}
		*d.out = v
	}
	if f.EvictionHard != nil {
		c.EvictionHard = f.EvictionHard
	}
	return c, nil
}

// Ours is imagefleet's image GC policy.
type Ours struct {
	HighThresholdPercent, LowThresholdPercent int
	MaxAge                                    time.Duration
	// CapacityBytes of the image filesystem, to compare quantity thresholds (0: unknown, skipped).
	CapacityBytes int64
}

// Warning is one setting where the two would fight.
type Warning struct {
	Setting string // the kubelet's setting name, e.g. imageGCHighThresholdPercent or evictionHard[imagefs.available]
	Message string
}

func (w Warning) String() string { return w.Setting + ": " + w.Message }

// Check returns the settings where the kubelet and imagefleet would fight in mode.
func Check(k Config, mode string, ours Ours) ([]Warning, error) {
	var out []Warning
	add := func(setting, format string, args ...any) {
		out = append(out, Warning{Setting: setting, Message: fmt.Sprintf(format, args...)})
	}
	kubeletGCOff := k.ImageGCHighThresholdPercent == 100 && k.ImageMaximumGCAge == 0
	switch mode {
	case FirstResponder:
		if kubeletGCOff {
			add("imageGCHighThresholdPercent", "100 with imageMaximumGCAge 0 turns the kubelet's image GC off: first-responder mode has no backstop (use takeover mode, or give the kubelet a threshold above imagefleet's %d)", ours.HighThresholdPercent)
		} else if int(k.ImageGCHighThresholdPercent) <= ours.HighThresholdPercent {
			add("imageGCHighThresholdPercent", "the kubelet's %d is at or below imagefleet's high threshold %d: the kubelet's GC (every 5 minutes) acts first; set --image-gc-high-threshold below %d", k.ImageGCHighThresholdPercent, ours.HighThresholdPercent, k.ImageGCHighThresholdPercent)
		}
		if k.ImageMaximumGCAge > 0 && (ours.MaxAge == 0 || k.ImageMaximumGCAge <= ours.MaxAge) {
			add("imageMaximumGCAge", "the kubelet removes images unused for %v, imagefleet for %v: the kubelet's age GC acts first", k.ImageMaximumGCAge, ageText(ours.MaxAge))
		}
	case Takeover:
		if k.ImageGCHighThresholdPercent != 100 {
			add("imageGCHighThresholdPercent", "%d: in takeover mode set it to 100 (and imageMaximumGCAge to 0) so the kubelet does not start its image GC", k.ImageGCHighThresholdPercent)
		}
		if k.ImageMaximumGCAge != 0 {
			add("imageMaximumGCAge", "%v: in takeover mode set it to 0 (and imageGCHighThresholdPercent to 100) so the kubelet does not start its image GC", k.ImageMaximumGCAge)
		}
	default:
		return nil, fmt.Errorf("kubelet coexistence mode %q is neither %s nor %s", mode, FirstResponder, Takeover)
	}
	// The eviction manager (every 10 s) deletes every unused image (DeleteUnusedImages) and then evicts pods
	// once image fs available falls below its threshold. imagefleet lets free space fall to 100 - high
	// before it acts: a threshold above that fires first.
	keeps := 100 - ours.HighThresholdPercent
	for _, set := range []struct {
		name string
		m    map[string]string
	}{{"evictionHard", k.EvictionHard}, {"evictionSoft", k.EvictionSoft}} {
		for _, sig := range []string{"imagefs.available", "containerfs.available"} {
			v, ok := set.m[sig]
			if !ok {
				continue
			}
			pct, known, err := percentOf(v, ours.CapacityBytes)
			if err != nil {
				return nil, fmt.Errorf("kubelet config: %s[%s] %q: %w", set.name, sig, v, err)
			}
			if known && pct > float64(keeps) {
				add(set.name+"["+sig+"]", "%s is above the %d%% free imagefleet keeps at its high threshold %d%%: the eviction manager deletes every unused image and then evicts pods before imagefleet's GC acts; set it to at most %d%% (\"0%%\" turns it off) or set --image-gc-high-threshold to at most %d",
					v, keeps, ours.HighThresholdPercent, keeps, 100-int(pct+0.999))
			}
		}
	}
	return out, nil
}

func ageText(d time.Duration) string {
	if d == 0 {
		return "never (0s)"
	}
	return d.String()
}

// percentOf turns a threshold ("15%" or a quantity) into a percent of capacity; known is false for a quantity
// with an unknown capacity.
func percentOf(v string, capacity int64) (pct float64, known bool, err error) {
	if p, ok := strings.CutSuffix(strings.TrimSpace(v), "%"); ok {
		f, err := strconv.ParseFloat(p, 64)
		if err != nil || f < 0 || f > 100 {
			return 0, false, fmt.Errorf("not a percentage between 0%% and 100%%")
		}
		return f, true, nil
	}
	q, err := resource.ParseQuantity(v)
	if err != nil {
		return 0, false, err
	}
	if capacity <= 0 {
		return 0, false, nil
	}
	return float64(q.Value()) * 100 / float64(capacity), true, nil
}
