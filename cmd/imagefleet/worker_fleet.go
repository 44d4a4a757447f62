package main

import (
	"context"
	"runtime/debug"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/imagefleet/imagefleet/services/fleet"
)

var fleetFlags struct {
	fs              *pflag.FlagSet
	nodeLabels      string
	heartbeatPeriod time.Duration
	inventoryConc   int
}

func init() {
	registerWorker(workerDef{
		Name: "heartbeat", Default: true, NeedsCRI: true,
		Flags: func(fs *pflag.FlagSet) {
			fleetFlags.fs = fs
			fs.StringVar(&fleetFlags.nodeLabels, "node-labels", "", "labels of this node for fleet selectors, k=v,k2=v2")
			fs.DurationVar(&fleetFlags.heartbeatPeriod, "heartbeat-period", 10*time.Second, "how often the node announces itself to the fleet registry")
		},
		Build: func(_ context.Context, env *agentEnv) (runnable, error) {
			labels, err := fleet.ParseLabels(fleetFlags.nodeLabels)
			if err != nil {
				return nil, err
			}
			return fleet.NewHeartbeat(fleet.HeartbeatConfig{Node: env.Node, Labels: labels, Period: fleetFlags.heartbeatPeriod,
				AgentVersion: agentVersion(), Workers: agentWorkerNames(), Logger: env.Log}, env.CRI, env.Bus)
		},
	})
	registerWorker(workerDef{
		Name: "inventory", Default: false,
		Flags: func(fs *pflag.FlagSet) {
			fs.IntVar(&fleetFlags.inventoryConc, "inventory-concurrency", 32, "image events one inventory replica applies at once")
		},
		Build: func(ctx context.Context, env *agentEnv) (runnable, error) {
			return fleet.NewInventory(ctx, fleet.InventoryConfig{Replica: env.Node, Concurrency: fleetFlags.inventoryConc,
				Logger: env.Log}, env.Bus)
		},
	})
}

// agentVersion is the module version the binary was built from ("dev" for a local build).
func agentVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}

// agentWorkerNames reads the agent's --workers (the heartbeat reports them).
func agentWorkerNames() []string {
	list := ""
	if fleetFlags.fs != nil {
		if f := fleetFlags.fs.Lookup("workers"); f != nil {
			list = f.Value.String()
		}
	}
	if list == "" {
		list = defaultWorkers()
	}
	var out []string
	for _, w := range strings.Split(list, ",") {
		if w = strings.TrimSpace(w); w != "" {
			out = append(out, w)
		}
	}
	return out
}
