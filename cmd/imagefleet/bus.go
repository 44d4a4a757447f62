package main

import (
	"fmt"
	"log/slog"
	"slices"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/internal/records"
	"github.com/imagefleet/imagefleet/services/fleet"
	"github.com/imagefleet/imagefleet/services/gc"
	"github.com/imagefleet/imagefleet/services/kevents"
	"github.com/imagefleet/imagefleet/services/podindex"
	"github.com/imagefleet/imagefleet/services/puller"
)

func newBusCmd(cl *cli) *cobra.Command {
	var config, listen, storeDir, name string
	cmd := &cobra.Command{
		Use:   "bus [--config FILE]",
		Short: "Run a standalone NATS server (the embedded nats-server) from a config file",
		Long: `Run a nats-server with JetStream in this process until interrupted: a single server, or one server of a
cluster (deploy/nats/cluster/server-{1,2,3}.conf). --listen and --store-dir override the file.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if config == "" && storeDir == "" {
				storeDir = defaultDataDir() + "/nats"
			}
			srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: config, Listen: listen, StoreDir: storeDir, ServerName: name})
			if err != nil {
				return err
			}
			slog.Info("nats-server ready", "url", srv.ClientURL(), "config", config)
			fmt.Fprintln(cmd.OutOrStdout(), srv.ClientURL())
			<-cmd.Context().Done()
			srv.Shutdown()
			return nil
		},
	}
	cmd.AddCommand(newBusInitCmd(cl), newGenCredsCmd(cl), newBusStreamsCmd(cl), newBusRemoveLegacyPullCmd(cl), newBusAuthCalloutCmd(cl), newBusKeysCmd(cl))
	fs := cmd.Flags()
	fs.StringVar(&config, "config", "", "nats-server configuration file")
	fs.StringVar(&listen, "listen", "", "client listen address host:port (overrides the file; default 127.0.0.1:4222)")
	fs.StringVar(&storeDir, "store-dir", "", "JetStream store directory (overrides the file)")
	fs.StringVar(&name, "server-name", "", "server name (overrides the file)")
	return cmd
}

func newBusInitCmd(cl *cli) *cobra.Command {
	var replicas, pullReplicas int
	var inventoryPartitioned bool
	cmd := &cobra.Command{
		Use:   "init [--stream-replicas N] [--pull-replicas N] [--inventory-partitioned]",
		Short: "Create every stream and bucket the workers use (run once with the admin identity; idempotent)",
		Long: `Create, or bring to the current settings, the streams (events, pull queue, dead letters, rollouts; with
--inventory-partitioned the inventory's partitioned copy of the image events, which is otherwise only
migrated if it exists) and
the key-value buckets (records, pod snapshots, pull backoff and records, heartbeats, inventory) with the
default settings. Agents with node identities may not create streams or buckets: run this first with the
admin identity (--nkey admin.nk). Agents that find them open them as they are.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			opts := cl.busOptions("imagefleet-bus-init")
			opts.Replicas = replicas
			b, err := bus.Connect(ctx, cl.natsURL, opts)
			if err != nil {
				return err
			}
			defer b.Close()
			if pullReplicas < 0 || pullReplicas > 5 {
				return fmt.Errorf("--pull-replicas %d: want 1 to 5, or 0 for the replicas of the other streams", pullReplicas)
			}
			if err := b.EnsureStreams(ctx, bus.StreamsConfig{PullReplicas: pullReplicas}); err != nil {
				return err
			}
			steps := []struct {
				what   string
				ensure func() error
			}{
				{"image records", func() error { _, err := records.OpenStore(ctx, b, ""); return err }},
				{"pod index snapshots", func() error { _, err := podindex.OpenStore(ctx, b, ""); return err }},
				{"puller", func() error { return puller.EnsureBuckets(ctx, b, puller.Config{}) }},
				{"fleet", func() error { return fleet.EnsureBuckets(ctx, b, 0) }},
				{"inventory partitions", func() error {
					if inventoryPartitioned {
						return fleet.EnsureInventoryStream(ctx, b, 0)
					}
					return fleet.MigrateInventoryStream(ctx, b, 0)
				}},
				{"kube-events", func() error { return kevents.EnsureBucket(ctx, b) }},
				{"gc lease", func() error { return gc.EnsureLeaseBucket(ctx, b) }},
				{"gc policy", func() error { return gc.EnsurePolicyBucket(ctx, b) }},
				{"gc copies", func() error { _, err := b.KV(ctx, fleet.CopiesBucketConfig()); return err }},
			}
			for _, s := range steps {
				if err := s.ensure(); err != nil {
					return fmt.Errorf("%s: %w", s.what, err)
				}
			}
			// Buckets made with the server's consumer limit (compat_kv_consumer_limits.go).
			if err := raiseBucketConsumers(ctx, b); err != nil {
				return err
			}
			names, err := b.StreamNames(ctx)
			if err != nil {
				return err
			}
			slices.Sort(names)
			if cl.jsonOutput() {
				return printJSON(cmd.OutOrStdout(), map[string]any{"streams": names})
			}
			for _, n := range names {
				fmt.Fprintln(cmd.OutOrStdout(), n)
			}
			return nil
		},
	}
	cmd.Flags().IntVar(&replicas, "stream-replicas", 0, "replicas of every stream and bucket (3 on a 3-server cluster; 0: 1 for new ones, existing ones keep theirs)")
	cmd.Flags().IntVar(&pullReplicas, "pull-replicas", 0, "replicas of the pull work queue's partitions and so of every node's pull consumer (1: one Raft group less per node on a cluster, docs/scale.md; 0: as --stream-replicas for new ones, existing ones keep theirs)")
	cmd.Flags().BoolVar(&inventoryPartitioned, "inventory-partitioned", false, "create IMAGEFLEET_INVENTORY, the partitioned copy of the image events that inventories run with --inventory-partitioned read (docs/operations.md); without it an existing one is only migrated")
	return cmd
}
