package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// rolloutFlags are the flags of fleet gc and fleet pull.
type rolloutFlags struct {
	id           string
	selector     string
	nodes        string
	initialBatch int
	nodeTimeout  time.Duration
	includeLost  bool
	replicas     int
	maxInFlight  int
	maxFailures  string
	memProfile   string
}

func (f *rolloutFlags) register(cmd *cobra.Command) {
	fs := cmd.Flags()
	fs.StringVar(&f.id, "id", "", "rollout id (default: generated); the id of an earlier rollout resumes it, acting on no node twice")
	fs.StringVarP(&f.selector, "selector", "l", "", "label selector of the nodes (k=v,k2!=v2,k3 in (a,b)); default all")
	fs.StringVar(&f.nodes, "nodes", "", "act on exactly these nodes, in this order (instead of the registry and --selector)")
	fs.IntVar(&f.initialBatch, "initial-batch", fleet.SlowStartInitialBatchSize, "size of the first batch; each next batch doubles")
	fs.DurationVar(&f.nodeTimeout, "node-timeout", 60*time.Second, "a node that does not answer within this time has failed")
	fs.IntVar(&f.maxInFlight, "max-in-flight", fleet.DefaultMaxInFlight, "at most this many nodes acted on at once inside a batch (a batch still waits for all its nodes)")
	fs.StringVar(&f.maxFailures, "max-failures", "0", "failure budget: go on to the next batch while at most N nodes, or P% of the planned nodes (rounded down), have failed; 0 stops after the first batch with a failure. A resumed rollout keeps its budget")
	fs.BoolVar(&f.includeLost, "include-lost", false, "also act on nodes the registry shows as lost")
	fs.IntVar(&f.replicas, "stream-replicas", 0, "replicas of the rollout stream (3 on a 3-server cluster; 0: 1 if new, else kept)")
	fs.StringVar(&f.memProfile, "mem-profile", "", "write the orchestrator's allocation profile to this file at the end (diagnostics)")
	_ = fs.MarkHidden("mem-profile")
}

// plan picks the nodes and builds the rollout config. From the registry (not --nodes), it also returns the
// planned nodes' JetStream domains as a pre-pull's option, read with the nodes: a pre-pull needs no second
// read of the registry.
func (f *rolloutFlags) plan(ctx context.Context, b *bus.Bus, kind string) (fleet.RolloutConfig, []fleet.PullWatchOption, error) {
	if f.initialBatch < 1 {
		return fleet.RolloutConfig{}, nil, fmt.Errorf("--initial-batch %d must be at least 1", f.initialBatch)
	}
	if f.maxInFlight < 1 {
		return fleet.RolloutConfig{}, nil, fmt.Errorf("--max-in-flight %d must be at least 1", f.maxInFlight)
	}
	budget, err := fleet.ParseFailureBudget(f.maxFailures)
	if err != nil {
		return fleet.RolloutConfig{}, nil, fmt.Errorf("--max-failures: %w", err)
	}
	cfg := fleet.RolloutConfig{ID: f.id, Kind: kind, Selector: f.selector, InitialBatch: f.initialBatch,
		NodeTimeout: f.nodeTimeout, Replicas: f.replicas, MaxInFlight: f.maxInFlight, FailureBudget: budget}
	if cfg.ID == "" {
		cfg.ID = fleet.NewRolloutID(kind)
	}
	if f.nodes != "" {
		for _, n := range strings.Split(f.nodes, ",") {
			if n = strings.TrimSpace(n); n != "" {
				cfg.Nodes = append(cfg.Nodes, n)
			}
		}
		return cfg, nil, nil
	}
	p, err := fleet.Plan(ctx, b, f.selector, f.includeLost, time.Now)
	cfg.Nodes, cfg.Skipped = p.Nodes, p.Skipped
	return cfg, []fleet.PullWatchOption{fleet.WithNodeDomains(p.Domains)}, err
}
