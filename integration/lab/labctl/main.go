// Command labctl is the operator's lab helper (deploy/lab/up.sh and down.sh run it): it pushes test images
// to a registry, waits for a CRI runtime to answer, and removes every pod of a runtime. The Debian packages
// give neither an image builder nor a CRI client (crictl is not packaged), so the lab brings its own.
//
//	labctl push -registry 127.0.0.1:5000 -busybox lab/pause:1
//	labctl push -registry 127.0.0.1:5000 -size 20m lab/filler-1:1 lab/filler-2:1
//	labctl wait -cri unix:///tmp/ifl-lab/containerd.sock -timeout 30s
//	labctl rm-pods -cri unix:///tmp/ifl-lab/containerd.sock
//	labctl kube-up -dir /tmp/ifl-kube/run [-cri unix:///tmp/ifl-kube/ctrd/containerd.sock -cni-dir /tmp/ifl-kube/ctrd/cni]
//	labctl kube-down -dir /tmp/ifl-kube/run
//
// kube-up starts integration/kubelab's cluster (etcd, kube-apiserver and, with -cri, a kubelet) detached, so
// it outlives labctl; kube-down removes it (deploy/lab/kube/up.sh and down.sh run them).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/integration/lab"
	"github.com/imagefleet/imagefleet/services/cri"
)

const usage = `usage:
  labctl push -registry HOST:PORT [-size SIZE] [-busybox] [-user U -password P] REPO:TAG...
  labctl wait -cri ENDPOINT [-timeout 30s]
  labctl rm-pods -cri ENDPOINT
  labctl kube-up -dir DIR [-bin DIR] [-nodes node-1,...] [-cri ENDPOINT -cni-dir DIR] [-kubelet-config FILE] [-controllers]
  labctl kube-ns -dir DIR NAMESPACE...
  labctl kube-down -dir DIR`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "labctl:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return errors.New(usage)
	}
	fs := flag.NewFlagSet("labctl "+args[0], flag.ContinueOnError)
	switch args[0] {
	case "push":
		registry := fs.String("registry", "127.0.0.1:5000", "registry host:port")
		size := fs.String("size", "0", "approximate image size: bytes, or with a k, m or g suffix")
		busybox := fs.Bool("busybox", false, "add the host's static busybox as /bin/busybox and make the image sleep forever (a pause image)")
		user := fs.String("user", "", "basic auth user")
		password := fs.String("password", "", "basic auth password")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		n, err := parseSize(*size)
		if err != nil {
			return err
		}
		var opts []lab.PushOption
		if *user != "" {
			opts = append(opts, lab.WithAuth(*user, *password))
		}
		if *busybox {
			bb, err := lab.BusyboxPath()
			if err != nil {
				return err
			}
			opts = append(opts, lab.WithBusybox(bb))
		}
		if fs.NArg() == 0 {
			return errors.New("push: no REPO:TAG given")
		}
		for _, repoTag := range fs.Args() {
			p, err := lab.Push(ctx, *registry, repoTag, n, opts...)
			if err != nil {
				return err
			}
			fmt.Printf("%s\t%s\tid=%s\tsize=%d\n", p.Ref, p.Digest, p.ID, p.Size)
		}
		return nil
	case "wait":
		endpoint := fs.String("cri", "", "CRI endpoint (unix:///path)")
		timeout := fs.Duration("timeout", 30*time.Second, "how long to wait")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		return waitCRI(ctx, *endpoint, *timeout)
	case "rm-pods":
		endpoint := fs.String("cri", "", "CRI endpoint (unix:///path)")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		return lab.RemovePods(ctx, *endpoint)
	case "kube-up":
		dir := fs.String("dir", "/tmp/ifl-kube/run", "the cluster's directory (PKI, data, logs, kubeconfigs, kubelet root)")
		bin := fs.String("bin", "", "directory of kube-apiserver, kubelet and etcd (default: deploy/lab/kube/build.sh's for this checkout)")
		nodes := fs.String("nodes", "node-1", "node identities given a token; a kubelet registers the first")
		endpoint := fs.String("cri", "", "CRI endpoint of a runtime for a kubelet (unix:///path); none: no kubelet")
		cniDir := fs.String("cni-dir", "", "that runtime's CNI conf and bin directory")
		kcfg := fs.String("kubelet-config", "", "a file of KubeletConfiguration fields to add (YAML)")
		controllers := fs.Bool("controllers", false, "also run kube-controller-manager and kube-scheduler (DaemonSets, Deployments and StatefulSets become pods)")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		opts := kubelab.Options{Dir: *dir, BinDir: *bin, Nodes: strings.Split(*nodes, ","), CRIEndpoint: *endpoint,
			CNIDir: *cniDir, Log: os.Stderr, Detach: true, Controllers: *controllers}
		if *kcfg != "" {
			b, err := os.ReadFile(*kcfg)
			if err != nil {
				return err
			}
			opts.KubeletConfig = string(b)
		}
		if _, err := os.Stat(filepath.Join(*dir, "state.json")); err == nil {
			return fmt.Errorf("kube-up: a cluster already lives in %s: labctl kube-down -dir %s first", *dir, *dir)
		}
		c, err := kubelab.Start(ctx, opts)
		if err != nil {
			return err
		}
		fmt.Printf("kube lab up:\n  apiserver   %s (logs in %s)\n  admin       export KUBECONFIG=%s\n", c.Server(), c.Dir(), c.KubeconfigPath("admin"))
		for _, n := range opts.Nodes {
			fmt.Printf("  node        %s: --kubeconfig %s\n", n, c.KubeconfigPath(n))
		}
		if *endpoint != "" {
			fmt.Printf("  kubelet     node %s, Pods API socket %s, static pods in %s\n", opts.Nodes[0], c.PodsSocket(), c.StaticPodPath())
			fmt.Printf("  namespaces  labctl kube-ns -dir %s NS  (the default ServiceAccount and kube-root-ca.crt a pod needs)\n", *dir)
		}
		return nil
	case "kube-ns":
		dir := fs.String("dir", "/tmp/ifl-kube/run", "the cluster's directory")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		for _, ns := range fs.Args() {
			if err := kubelab.PrepareNamespaceIn(ctx, *dir, ns); err != nil {
				return err
			}
		}
		return nil
	case "kube-down":
		dir := fs.String("dir", "/tmp/ifl-kube/run", "the cluster's directory")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		return kubelab.Down(*dir)
	default:
		return fmt.Errorf("unknown command %q\n%s", args[0], usage)
	}
}

func waitCRI(ctx context.Context, endpoint string, timeout time.Duration) error {
	c, err := cri.Dial(cri.Config{Endpoint: endpoint, Timeout: 2 * time.Second})
	if err != nil {
		return fmt.Errorf("wait: %w", err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		name, version, err := c.Version(ctx)
		if err == nil {
			fmt.Printf("%s %s at %s\n", name, version, endpoint)
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for CRI at %s: %w (last: %v)", endpoint, ctx.Err(), err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// parseSize reads "1048576", "512k", "20m" or "1g" (powers of 1024).
func parseSize(s string) (int64, error) {
	mult := int64(1)
	switch {
	case strings.HasSuffix(strings.ToLower(s), "k"):
		mult = 1 << 10
	case strings.HasSuffix(strings.ToLower(s), "m"):
		mult = 1 << 20
	case strings.HasSuffix(strings.ToLower(s), "g"):
		mult = 1 << 30
	}
	if mult > 1 {
		s = s[:len(s)-1]
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("parse size %q: want bytes or a number with a k, m or g suffix", s)
	}
	return n * mult, nil
}
