package main

import (
	"context"
	"fmt"
	"log/slog"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/imagefleet/imagefleet/internal/kubeletcfg"
	"github.com/imagefleet/imagefleet/services/fleet/controller"
	"github.com/imagefleet/imagefleet/services/gc"
	"github.com/imagefleet/imagefleet/services/kevents"
)

// warnKubeletConfig reads --kubelet-config and logs a warning, with the kubelet setting's name, for each
// place where the kubelet's image GC or eviction manager would fight imagefleet's GC in the
// --kubelet-coexistence mode. A file that cannot be read stops the agent: the operator asked for the check.
func warnKubeletConfig(c *agentConfig, cfg gc.Config, log *slog.Logger) error {
	if c.KubeletConfig == "" {
		if c.KubeletCoexistence != kubeletcfg.FirstResponder && c.KubeletCoexistence != kubeletcfg.Takeover {
			return fmt.Errorf("invalid configuration: --kubelet-coexistence %q is neither %s nor %s", c.KubeletCoexistence, kubeletcfg.FirstResponder, kubeletcfg.Takeover)
		}
		return nil
	}
	k, err := kubeletcfg.Load(c.KubeletConfig)
	if err != nil {
		return err
	}
	ws, err := kubeletcfg.Check(k, c.KubeletCoexistence, kubeletcfg.Ours{HighThresholdPercent: cfg.Policy.HighThresholdPercent,
		LowThresholdPercent: cfg.Policy.LowThresholdPercent, MaxAge: cfg.Policy.MaxAge, CapacityBytes: cfg.CapacityBytes})
	if err != nil {
		return err
	}
	for _, w := range ws {
		log.Warn("kubelet and imagefleet would fight over the image filesystem", "setting", w.Setting, "mode", c.KubeletCoexistence,
			"kubelet_config", c.KubeletConfig, "detail", w.Message)
	}
	if len(ws) == 0 {
		log.Info("kubelet configuration read: no conflict with imagefleet's GC", "mode", c.KubeletCoexistence, "kubelet_config", c.KubeletConfig)
	}
	return nil
}

// kubeRESTConfig is the API-server client configuration of --kubeconfig, or the pod's in-cluster config
// when it is empty.
func kubeRESTConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig == "" {
		cfg, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("kubernetes client: no --kubeconfig and no in-cluster config: %w", err)
		}
		return cfg, nil
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: kubeconfig %s: %w", kubeconfig, err)
	}
	return cfg, nil
}

// buildKubeEvents builds the Kubernetes Events bridge. Its client has the kubelet's event rate
// (eventRecordQPS 50, eventBurst 100).
func buildKubeEvents(ctx context.Context, c *agentConfig, env *agentEnv) (runnable, error) {
	rc, err := kubeRESTConfig(c.Kubeconfig)
	if err != nil {
		return nil, err
	}
	rc = rest.CopyConfig(rc)
	rc.QPS, rc.Burst, rc.UserAgent = 50, 100, "imagefleet-kube-events/"+agentVersion()
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	cfg := c.KubeEvents
	cfg.Node, cfg.Logger = env.Node, env.Log
	return kevents.New(ctx, cfg, cs, env.Bus)
}

// buildController builds the controller of ImagePrePull and ImageGC objects, on --kubeconfig or the pod's
// in-cluster config.
func buildController(_ context.Context, c *agentConfig, env *agentEnv) (runnable, error) {
	rc, err := kubeRESTConfig(c.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("controller: %w", err)
	}
	rc = rest.CopyConfig(rc)
	rc.UserAgent = "imagefleet-controller/" + agentVersion()
	cfg := c.Controller
	cfg.REST, cfg.Identity, cfg.StreamReplicas, cfg.Logger = rc, env.Node, c.Replicas, env.Log
	return controller.New(cfg, env.Bus)
}
