package main

import (
	"context"
	"time"

	"github.com/spf13/pflag"

	"github.com/imagefleet/imagefleet/services/cache"
	"github.com/imagefleet/imagefleet/services/detector"
)

var (
	detectPeriod time.Duration
	cachePeriod  time.Duration
)

func init() {
	registerWorker(workerDef{
		Name: "detector", Default: true, NeedsCRI: true,
		Flags: func(fs *pflag.FlagSet) {
			fs.DurationVar(&detectPeriod, "image-detect-period", 5*time.Minute, "how often the detector refreshes image records")
		},
		Build: func(_ context.Context, env *agentEnv) (runnable, error) {
			return detector.New(detector.Config{Node: env.Node, Period: detectPeriod, Logger: env.Log}, env.CRI, env.Bus)
		},
	})
	registerWorker(workerDef{
		Name: "cache", Default: true, NeedsCRI: true,
		Flags: func(fs *pflag.FlagSet) {
			fs.DurationVar(&cachePeriod, "image-cache-period", 30*time.Second, "how often the image list cache refreshes")
		},
		Build: func(_ context.Context, env *agentEnv) (runnable, error) {
			return cache.New(cache.Config{Node: env.Node, Period: cachePeriod, Logger: env.Log}, env.CRI, env.Bus)
		},
	})
}
