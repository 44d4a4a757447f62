package main

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/spf13/pflag"

	"github.com/imagefleet/imagefleet/services/podindex"
)

var (
	podManifestPath    string
	fileCheckFrequency time.Duration
	podIndexFlush      time.Duration
)

func init() {
	registerWorker(workerDef{
		Name: "podindex", Default: true,
		Flags: func(fs *pflag.FlagSet) {
			fs.StringVar(&podManifestPath, "pod-manifest-path", "", "directory (or file) of static pod manifests; empty: no static pod source")
			fs.DurationVar(&fileCheckFrequency, "file-check-frequency", 20*time.Second, "how often the static pod manifests are read again besides file notifications")
			fs.DurationVar(&podIndexFlush, "pod-index-flush-interval", 5*time.Second, "how often the pod index writes its snapshot while it keeps up with its events")
		},
		Build: func(_ context.Context, env *agentEnv) (runnable, error) {
			ix, err := podindex.New(podindex.Config{Node: env.Node, FlushInterval: podIndexFlush, Logger: env.Log}, env.Bus)
			if err != nil {
				return nil, err
			}
			if podManifestPath == "" {
				return ix, nil
			}
			src, err := podindex.NewStaticSource(podindex.StaticConfig{Node: env.Node, ManifestPath: podManifestPath,
				ResyncPeriod: fileCheckFrequency, Logger: env.Log}, env.Bus, env.Bus)
			if err != nil {
				return nil, err
			}
			return both{ix, src}, nil
		},
	})
}

// both runs two runnables until ctx ends or one fails.
type both [2]runnable

func (r both) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, w := range r {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if errs[i] = w.Run(ctx); errs[i] != nil {
				cancel()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
