package kubelab

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// controllerArgs are kube-controller-manager's flags: the admin identity for everything (one kubeconfig, no
// per-controller ServiceAccounts), no leader election and no serving port (single instance, loopback lab).
// nodeipam is off: the lab has no pod network to allocate. In 1.37 the names service-lb-controller, route
// and cloud-node-lifecycle are unknown: listing them in --controllers makes it exit at once.
func (c *Cluster) controllerArgs() []string {
	kc := c.KubeconfigPath("admin")
	return []string{
		"--kubeconfig=" + kc, "--authentication-kubeconfig=" + kc, "--authorization-kubeconfig=" + kc,
		"--leader-elect=false",
		"--service-account-private-key-file=" + c.pki.path("sa.key"), "--root-ca-file=" + c.CAFile(),
		"--use-service-account-credentials=false",
		"--bind-address=127.0.0.1", "--secure-port=0",
		"--controllers=*,-nodeipam",
	}
}

// schedulerArgs are kube-scheduler's flags, on the same terms as the controller-manager's.
func (c *Cluster) schedulerArgs() []string {
	kc := c.KubeconfigPath("admin")
	return []string{
		"--kubeconfig=" + kc, "--authentication-kubeconfig=" + kc, "--authorization-kubeconfig=" + kc,
		"--leader-elect=false",
		"--bind-address=127.0.0.1", "--secure-port=0",
	}
}

// startControllers starts kube-controller-manager and kube-scheduler; waitControllers waits for them. The
// two are apart so the kubelet comes up while the controllers sync.
func (c *Cluster) startControllers() error {
	c.controllerManager = &proc{name: "kube-controller-manager", bin: filepath.Join(c.bin, "kube-controller-manager"), dir: c.dir, detach: c.opts.Detach, args: c.controllerArgs()}
	if err := c.controllerManager.start(); err != nil {
		return fmt.Errorf("kubelab: %w", err)
	}
	c.scheduler = &proc{name: "kube-scheduler", bin: filepath.Join(c.bin, "kube-scheduler"), dir: c.dir, detach: c.opts.Detach, args: c.schedulerArgs()}
	if err := c.scheduler.start(); err != nil {
		return fmt.Errorf("kubelab: %w", err)
	}
	return nil
}

// waitControllers waits until the controller-manager has done its first work, the `default` ServiceAccount
// and the kube-root-ca.crt ConfigMap in namespace default, with both processes still running. Neither serves
// a port here (--secure-port=0), so that is the readiness there is; a scheduler that cannot work shows in
// its log and in pods that stay Pending.
func (c *Cluster) waitControllers(ctx context.Context) error {
	cs, err := kubernetes.NewForConfig(c.AdminConfig())
	if err != nil {
		return err
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		_, saErr := cs.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		_, cmErr := cs.CoreV1().ConfigMaps("default").Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})
		for _, p := range []*proc{c.controllerManager, c.scheduler} {
			if !p.running() {
				return fmt.Errorf("kubelab: %s exited: %v\n%s", p.name, p.waitErr, p.logTail(30))
			}
		}
		if saErr == nil && cmErr == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kubelab: kube-controller-manager made no default ServiceAccount and kube-root-ca.crt in namespace default after 60s (%v; %v)\n%s",
				saErr, cmErr, c.controllerManager.logTail(30))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// stopControllers stops the scheduler and the controller-manager, first of all at Stop: nothing then
// recreates or reschedules the pods the clean-up removes.
func (c *Cluster) stopControllers() {
	for _, p := range []*proc{c.scheduler, c.controllerManager} {
		if p != nil {
			p.stop(5 * time.Second)
		}
	}
}

// LocalStorageClass is the StorageClass AddLocalVolumes makes, the cluster's default: no provisioner, a
// claim binds when its first pod is scheduled (WaitForFirstConsumer), to one of the lab's local volumes.
const LocalStorageClass = "lab-local"

// AddLocalVolumes gives the cluster storage for PersistentVolumeClaims, such as a StatefulSet's
// volumeClaimTemplates, which nothing could provision here: the default StorageClass LocalStorageClass
// (created once) and n `local` PersistentVolumes of the given size (Kubernetes quantity, e.g. "1Gi"), each a
// new directory DIR/volumes/NAME on this machine, pinned to the kubelet's node (Nodes[0]) by node affinity.
// The size is only matched against claims; nothing enforces it. Reclaim policy Retain: a released volume is
// not reused. It returns the volumes' names (lab-local-1, -2, ... continuing past those already there), and
// their directories are LocalVolumeDir(name). Binding needs the scheduler (Options.Controllers).
func (c *Cluster) AddLocalVolumes(ctx context.Context, n int, size string) ([]string, error) {
	qty, err := resource.ParseQuantity(size)
	if err != nil {
		return nil, fmt.Errorf("kubelab: local volume size: %w", err)
	}
	cs, err := c.Admin()
	if err != nil {
		return nil, err
	}
	mode := storagev1.VolumeBindingWaitForFirstConsumer
	reclaim := corev1.PersistentVolumeReclaimRetain
	_, err = cs.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{
			Name:        LocalStorageClass,
			Annotations: map[string]string{"storageclass.kubernetes.io/is-default-class": "true"},
		},
		Provisioner:       "kubernetes.io/no-provisioner",
		VolumeBindingMode: &mode,
		ReclaimPolicy:     &reclaim,
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("kubelab: create storageclass %s: %w", LocalStorageClass, err)
	}
	existing, err := cs.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("kubelab: list persistentvolumes: %w", err)
	}
	taken := map[string]bool{}
	for _, pv := range existing.Items {
		taken[pv.Name] = true
	}
	fs := corev1.PersistentVolumeFilesystem
	var names []string
	for i := 1; len(names) < n; i++ {
		name := fmt.Sprintf("%s-%d", LocalStorageClass, i)
		if taken[name] {
			continue
		}
		dir := c.LocalVolumeDir(name)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return names, fmt.Errorf("kubelab: local volume %s: %w", name, err)
		}
		pv := &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:                      corev1.ResourceList{corev1.ResourceStorage: qty},
				AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				PersistentVolumeReclaimPolicy: reclaim,
				StorageClassName:              LocalStorageClass,
				VolumeMode:                    &fs,
				PersistentVolumeSource:        corev1.PersistentVolumeSource{Local: &corev1.LocalVolumeSource{Path: dir}},
				NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{
					NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{
						Key: "kubernetes.io/hostname", Operator: corev1.NodeSelectorOpIn, Values: []string{c.opts.Nodes[0]},
					}}}},
				}},
			},
		}
		if _, err := cs.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
			return names, fmt.Errorf("kubelab: create persistentvolume %s: %w", name, err)
		}
		names = append(names, name)
	}
	return names, nil
}

// LocalVolumeDir is the directory behind local volume name (AddLocalVolumes): what a pod writes to its
// claim lands there.
func (c *Cluster) LocalVolumeDir(name string) string { return filepath.Join(c.dir, "volumes", name) }
