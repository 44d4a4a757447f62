package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/source"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
)

// The readiness taint: a node registers with the taint an ImagePrePull with completionPolicy KeepNewNodes
// names (spec.readinessTaint, default readiness.k8s.io/imagefleet-prepull), so that it takes no pod before
// its images are warm; the keeper removes it from the Kubernetes Node of the same name (the agent's --node)
// once every such object with that key that selects the node has warmed it. A node that failed to warm
// keeps it. A Node whose taint no object names is left alone.
//
// The decision waits for the keeper to follow every KeepNewNodes object of the key that exists (the objects
// listed from the manager's cache, which a List waits to be synced): after a restart the Node reconciler can
// run before the ImagePrePull reconciler has handed the keeper each object, and a node warmed by the objects
// seen so far must not lose the taint that an object not seen yet holds. An object taken on kicks every
// tainted Node (kickAll).
//
// An outcome warms the Kubernetes Node it was recorded for (nodeID): a Node deleted and made again under
// its name (a new machine) is not warm by the outcomes of the one before.
//
// The Nodes are read from the manager's cache, cut down to their names and taints (nodeTaintsOnly): a fleet
// of Nodes costs the controller little memory. The Node reconciler is level-based: it looks at a Node when
// the Node changes, when one of its objects warmed it (kickNode), and when the objects change (kickAll).

// setupReadiness registers the Node reconciler with mgr.
func (k *keeper) setupReadiness(mgr ctrl.Manager) error {
	tainted := predicate.NewPredicateFuncs(func(o client.Object) bool {
		n, ok := o.(*corev1.Node)
		return ok && len(n.Spec.Taints) > 0
	})
	return ctrl.NewControllerManagedBy(mgr).Named("readiness-taint").
		For(&corev1.Node{}, builder.WithPredicates(tainted)).
		WatchesRawSource(source.Channel(k.kick, &handler.EnqueueRequestForObject{})).
		Complete(k)
}

// nodeTaintsOnly keeps of a cached Node its name, UID, creation time, resource version and taints.
func nodeTaintsOnly(obj any) (any, error) {
	n, ok := obj.(*corev1.Node)
	if !ok {
		return obj, nil
	}
	return &corev1.Node{TypeMeta: n.TypeMeta, ObjectMeta: metav1.ObjectMeta{Name: n.Name, UID: n.UID, ResourceVersion: n.ResourceVersion,
		CreationTimestamp: n.CreationTimestamp}, Spec: corev1.NodeSpec{Taints: n.Spec.Taints}}, nil
}

// kickNode asks the Node reconciler to look at node.
func (k *keeper) kickNode(node string) {
	n := &corev1.Node{}
	n.Name = node
	select {
	case k.kick <- event.GenericEvent{Object: n}:
	default:
		go func() {
			select {
			case k.kick <- event.GenericEvent{Object: n}:
			case <-k.base.Done():
			}
		}()
	}
}

// kickAll asks the Node reconciler to look at every tainted Node in the cache.
func (k *keeper) kickAll() {
	var list corev1.NodeList
	if err := k.c.List(k.base, &list); err != nil {
		if k.base.Err() == nil {
			k.log.Warn("listing the Nodes failed", "err", err)
		}
		return
	}
	for i := range list.Items {
		if len(list.Items[i].Spec.Taints) > 0 {
			k.kickNode(list.Items[i].Name)
		}
	}
}

// Reconcile removes from a Node each readiness taint whose objects all warmed it.
func (k *keeper) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	node := &corev1.Node{}
	if err := k.c.Get(ctx, req.NamespacedName, node); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	unseen, err := k.unfollowed(ctx)
	if err != nil {
		return ctrl.Result{}, err
	}
	id := nodeID{uid: node.UID, created: node.CreationTimestamp.Time}
	for _, t := range node.Spec.Taints {
		if unseen[t.Key] {
			continue
		}
		by, warm := k.warmFor(node.Name, id, t.Key)
		if !warm {
			k.rejoin(node.Name, id, t.Key)
			continue
		}
		removed, err := k.removeTaint(ctx, node.Name, t.Key)
		if err != nil {
			return ctrl.Result{}, err
		}
		if removed {
			k.log.Info("removed the readiness taint", "node", node.Name, "taint", t.Key, "objects", by)
			k.event(node, corev1.EventTypeNormal, "ImagesWarm", "Removed taint %s: warmed by ImagePrePull %s", t.Key, strings.Join(by, ", "))
		}
	}
	return ctrl.Result{}, nil
}

// unfollowed returns the readiness taint keys of the KeepNewNodes objects that exist (in the manager's cache)
// and that the keeper does not follow yet: their taints wait.
func (k *keeper) unfollowed(ctx context.Context) (map[string]bool, error) {
	var list v1alpha1.ImagePrePullList
	if err := k.c.List(ctx, &list); err != nil {
		return nil, fmt.Errorf("list ImagePrePulls: %w", err)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	unseen := map[string]bool{}
	for i := range list.Items {
		o, keep := keepsNewNodes(&list.Items[i])
		if !keep || o.DeletionTimestamp != nil || meta.IsStatusConditionTrue(o.Status.Conditions, v1alpha1.ConditionFailed) {
			continue // not followed, by design
		}
		if ko := k.objs[o.Name]; ko == nil || ko.uid != o.UID {
			unseen[readinessTaint(o)] = true
		}
	}
	return unseen, nil
}

// rejoin takes node on again for each object of key that selects it, took the name on before and has no
// outcome for its Node id: a Node made again under a reused name. The node must show in the registry by an agent started after the Node
// was made (the agent of the machine before it would be warmed instead), or the object's last join of it
// must have been taken before the Node existed (recorded under the name only); otherwise the agent's start
// takes it on (registryEntry).
func (k *keeper) rejoin(node string, id nodeID, key string) {
	k.mu.Lock()
	n, known := k.nodes[node]
	var objs []*keptObject
	for _, ko := range k.objs {
		if ko.key != key || !known || !ko.active || ko.stopped || !ko.selects(node, n, known) || ko.hasOutcomeLocked(node, id) {
			continue
		}
		j := ko.joins[node]
		_, planned := ko.planned[node]
		agentAfter := !n.started.Before(id.created)
		takenBefore := j != nil && j.done && j.uid == ""
		if (j == nil && !planned) || (j != nil && !j.done) || !(agentAfter || takenBefore) {
			continue // never taken on (a join comes from the registry), at work, or the agent is the old one's
		}
		objs = append(objs, ko)
	}
	k.mu.Unlock()
	for _, ko := range objs {
		k.consider(ko, node, n.domain)
	}
}

// warmFor reports whether the taint key of node (its Kubernetes Node id) may go: some object with that key
// selects the node, and every such object has taken on new nodes (its first rollout completed) and warmed
// it. by names them.
func (k *keeper) warmFor(node string, id nodeID, key string) (by []string, warm bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	n, known := k.nodes[node]
	if !k.synced {
		return nil, false
	}
	for _, ko := range k.objs {
		if ko.key != key || !ko.selects(node, n, known) {
			continue
		}
		if !ko.active || !ko.warmed(node, id) {
			return nil, false
		}
		by = append(by, ko.name)
	}
	sort.Strings(by)
	return by, len(by) > 0
}

// removeTaint removes the taint key from node, and nothing else: a merge patch of the Node's taints less
// that one, conditioned on the resource version it was read at, read again and retried on a conflict (a
// kubelet or another controller changed the Node meanwhile). removed is false when the taint was gone.
func (k *keeper) removeTaint(ctx context.Context, node, key string) (removed bool, err error) {
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		removed = false
		n := &corev1.Node{}
		if err := k.api.Get(ctx, client.ObjectKey{Name: node}, n); err != nil {
			return client.IgnoreNotFound(err)
		}
		rest := withoutTaint(n.Spec.Taints, key)
		if len(rest) == len(n.Spec.Taints) {
			return nil
		}
		patch, err := taintPatch(n.ResourceVersion, rest)
		if err != nil {
			return err
		}
		if err := k.c.Patch(ctx, n, client.RawPatch(types.MergePatchType, patch)); err != nil {
			return err
		}
		removed = true
		return nil
	})
	if err != nil {
		return false, fmt.Errorf("remove taint %s from node %s: %w", key, node, err)
	}
	return removed, nil
}

// withoutTaint returns taints less those with key, in their order.
func withoutTaint(taints []corev1.Taint, key string) []corev1.Taint {
	return slices.DeleteFunc(slices.Clone(taints), func(t corev1.Taint) bool { return t.Key == key })
}

// taintPatch is the merge patch that sets a Node's taints to rest if its resource version is still rv (the
// API server answers a Conflict otherwise). A merge patch replaces a list whole: rest is every other taint.
func taintPatch(rv string, rest []corev1.Taint) ([]byte, error) {
	var taints any = rest
	if len(rest) == 0 {
		taints = nil // null: the field goes
	}
	return json.Marshal(map[string]any{
		"metadata": map[string]any{"resourceVersion": rv},
		"spec":     map[string]any{"taints": taints},
	})
}
