package main

import (
	"context"
	"fmt"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/imagefleet/imagefleet/services/kevents"
)

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
