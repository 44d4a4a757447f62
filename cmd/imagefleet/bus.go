package main

import (
	"fmt"
	"log/slog"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/bus"
)

func init() { registerCommand(newBusCmd) }

func newBusCmd() *cobra.Command {
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
	fs := cmd.Flags()
	fs.StringVar(&config, "config", "", "nats-server configuration file")
	fs.StringVar(&listen, "listen", "", "client listen address host:port (overrides the file; default 127.0.0.1:4222)")
	fs.StringVar(&storeDir, "store-dir", "", "JetStream store directory (overrides the file)")
	fs.StringVar(&name, "server-name", "", "server name (overrides the file)")
	return cmd
}
