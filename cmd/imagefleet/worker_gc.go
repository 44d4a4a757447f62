package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/imagefleet/imagefleet/services/gc"
)

// gcFlags are the GC executor's agent flags (kubelet flag names where the kubelet has the setting).
var gcFlags struct {
	high, low   int
	minAge      time.Duration
	maxAge      time.Duration
	capacity    string
	pinned      []string
	period      time.Duration
	parallelism int
}

func init() {
	registerWorker(workerDef{
		Name: "gc", Default: true, NeedsCRI: true,
		Flags: func(fs *pflag.FlagSet) {
			d := gc.DefaultPolicy()
			fs.IntVar(&gcFlags.high, "image-gc-high-threshold", d.HighThresholdPercent, "percent of image filesystem usage at or above which image GC runs")
			fs.IntVar(&gcFlags.low, "image-gc-low-threshold", d.LowThresholdPercent, "percent of image filesystem usage image GC frees down to")
			fs.DurationVar(&gcFlags.minAge, "minimum-image-ttl-duration", d.MinAge, "minimum age of an image (since first detected) before GC may remove it")
			fs.DurationVar(&gcFlags.maxAge, "image-maximum-gc-age", d.MaxAge, "remove unused images older than this whatever the usage (0s: disabled)")
			fs.StringVar(&gcFlags.capacity, "image-fs-capacity", "", "byte quota for images (bytes, or a quantity like 10Gi): capacity = this, used = sum of image sizes (default: statfs of the image filesystem)")
			fs.StringSliceVar(&gcFlags.pinned, "pinned-images", nil, "references and globs of images GC never removes (REF,GLOB,...; e.g. busybox,*/pause:*)")
			fs.DurationVar(&gcFlags.period, "image-gc-period", 5*time.Minute, "period of the image GC loop")
			fs.IntVar(&gcFlags.parallelism, "image-gc-removal-parallelism", 16, "images removed at once (1: one by one, as the kubelet)")
		},
		Build: func(_ context.Context, env *agentEnv) (runnable, error) {
			cfg, err := gcConfig(env.Node)
			if err != nil {
				return nil, err
			}
			cfg.Logger = env.Log
			return gc.New(cfg, gc.Deps{Runtime: env.CRI, Bus: env.Bus})
		},
	})
}

// gcConfig builds the executor's Config from the flags.
func gcConfig(node string) (gc.Config, error) {
	var capacity int64
	if s := strings.TrimSpace(gcFlags.capacity); s != "" {
		q, err := resource.ParseQuantity(s)
		if err != nil {
			return gc.Config{}, fmt.Errorf("invalid configuration: imageFsCapacity (--image-fs-capacity) %q: %w", s, err)
		}
		capacity = q.Value()
	}
	if gcFlags.parallelism < 1 {
		return gc.Config{}, fmt.Errorf("invalid configuration: imageGCRemovalParallelism (--image-gc-removal-parallelism) %v must be a positive number", gcFlags.parallelism)
	}
	if gcFlags.period <= 0 {
		return gc.Config{}, fmt.Errorf("invalid configuration: imageGCPeriod (--image-gc-period) %v must be positive", gcFlags.period)
	}
	cfg := gc.Config{
		Node: node,
		Policy: gc.Policy{HighThresholdPercent: gcFlags.high, LowThresholdPercent: gcFlags.low,
			MinAge: gcFlags.minAge, MaxAge: gcFlags.maxAge},
		CapacityBytes: capacity, PinnedImages: gcFlags.pinned, Period: gcFlags.period,
		RemovalParallelism: gcFlags.parallelism,
	}
	if err := cfg.Validate(); err != nil {
		return gc.Config{}, err
	}
	return cfg, nil
}
