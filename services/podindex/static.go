package podindex

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/fsnotify/fsnotify"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/dump" //nolint:staticcheck // the kubelet's DeepHashObject uses this dump
	"sigs.k8s.io/yaml"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// maxManifestBytes is the kubelet's maxConfigLength: larger manifests are rejected.
const maxManifestBytes = 10 << 20

// StaticConfig configures the static-pod source of one node.
type StaticConfig struct {
	// Node is the node name (required): static pod names get "-<node>" appended and UIDs hash it.
	Node string
	// ManifestPath is the kubelet's --pod-manifest-path: a directory of manifests (or one file) (required).
	ManifestPath string
	// ResyncPeriod is how often the whole directory is read again besides file-system notifications
	// (default 20s, the kubelet's fileCheckFrequency).
	ResyncPeriod time.Duration
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// Now is the clock of config.seen (default time.Now).
	Now func() time.Time
}

// publisher stores pod events.
type publisher interface {
	PublishMsgs(ctx context.Context, msgs []bus.RawMsg) (uint64, error)
}

// requester asks the pod index which static pods it holds (to resume after a restart of the source).
type requester interface {
	Request(ctx context.Context, subject string, req, resp any) error
}

// StaticSource is the kubelet's file pod source: it reads the manifest directory at start, on every
// file-system notification and every ResyncPeriod, and publishes pod.added / pod.updated / pod.deleted so
// the index holds exactly the pods of the valid manifests.
type StaticSource struct {
	cfg StaticConfig
	pub publisher
	req requester
	log *slog.Logger

	mu sync.Mutex
	// known are the static pods published, by UID (their JSON without config.seen, to detect updates).
	known map[types.UID][]byte
	seen  map[types.UID]string
}

// NewStaticSource validates cfg. req may be nil (the source then starts as if the index held no static pod).
func NewStaticSource(cfg StaticConfig, pub publisher, req requester) (*StaticSource, error) {
	if cfg.Node == "" {
		return nil, fmt.Errorf("static pod source: node name is required")
	}
	if err := events.ValidateNodeName(cfg.Node); err != nil {
		return nil, fmt.Errorf("static pod source: %w", err)
	}
	if cfg.ManifestPath == "" {
		return nil, fmt.Errorf("static pod source: pod manifest path is required")
	}
	if cfg.ResyncPeriod < 0 {
		return nil, fmt.Errorf("static pod source: resync period %v must not be negative", cfg.ResyncPeriod)
	}
	if cfg.ResyncPeriod == 0 {
		cfg.ResyncPeriod = 20 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if pub == nil {
		return nil, fmt.Errorf("static pod source needs a publisher")
	}
	cfg.ManifestPath = strings.TrimRight(cfg.ManifestPath, string(os.PathSeparator))
	return &StaticSource{cfg: cfg, pub: pub, req: req, log: cfg.Logger.With("worker", "static-pods"),
		known: map[types.UID][]byte{}, seen: map[types.UID]string{}}, nil
}

// Run syncs at start, on changes and every ResyncPeriod until ctx ends.
func (s *StaticSource) Run(ctx context.Context) error {
	s.resume(ctx)
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("static pod source: watch %s: %w", s.cfg.ManifestPath, err)
	}
	defer func() { _ = w.Close() }()
	watching := false
	watch := func() {
		if !watching {
			if err := w.Add(s.cfg.ManifestPath); err == nil {
				watching = true
			}
		}
	}
	watch()
	sync := func() {
		if err := s.syncManifests(ctx); err != nil && ctx.Err() == nil {
			s.log.Warn("unable to read config path", "path", s.cfg.ManifestPath, "err", err)
		}
	}
	sync()
	tick := time.NewTicker(s.cfg.ResyncPeriod)
	defer tick.Stop()
	// Notifications come in bursts (an editor writes, renames, chmods): one sync per burst.
	debounce := time.NewTimer(time.Hour)
	debounce.Stop()
	defer debounce.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
			watch()
			sync()
		case <-debounce.C:
			sync()
		case ev, ok := <-w.Events:
			if !ok {
				return nil
			}
			if ev.Op&(fsnotify.Remove|fsnotify.Rename) != 0 && filepath.Clean(ev.Name) == s.cfg.ManifestPath {
				watching = false
			}
			debounce.Reset(100 * time.Millisecond)
		case err, ok := <-w.Errors:
			if !ok {
				return nil
			}
			s.log.Warn("manifest watch error", "path", s.cfg.ManifestPath, "err", err)
		}
	}
}

// resume learns the static pods the index already holds from a previous run of the source.
func (s *StaticSource) resume(ctx context.Context) {
	if s.req == nil {
		return
	}
	// The index usually starts with the source (same agent): give it a minute to answer. While it catches
	// up with its events it says so, and the source waits as long as that takes (the answer it then gives
	// is the one that matters: without it, a manifest removed while the agent was down keeps its pod). Only
	// the file source's pods are asked for, a page at a time.
	noIndexBy := time.Now().Add(time.Minute)
	var pods []json.RawMessage
	q := events.PodsQuery{Source: FileSource}
	for {
		var rep events.PodsReply
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := s.req.Request(rctx, events.QuerySubject(s.cfg.Node, events.QryPods), q, &rep)
		cancel()
		if err == nil {
			pods = append(pods, rep.Pods...)
			if !rep.Truncated {
				break
			}
			q.After = rep.Next
			continue
		}
		waiting := IsCatchingUp(err) || (errors.Is(err, bus.ErrNoResponders) && time.Now().Before(noIndexBy))
		if !waiting || ctx.Err() != nil {
			s.log.Info("static pod source starts without the index's pods", "err", err)
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(100 * time.Millisecond):
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, raw := range pods {
		var p v1.Pod
		if json.Unmarshal(raw, &p) != nil || p.Annotations[ConfigSourceAnnotationKey] != FileSource {
			continue
		}
		s.seen[p.UID] = p.Annotations[ConfigFirstSeenAnnotationKey]
		s.known[p.UID] = withoutSeen(&p)
	}
}

// Sync reads the manifests once and publishes the differences with the pods published before.
func (s *StaticSource) syncManifests(ctx context.Context) error {
	pods, readErr := s.read()
	s.mu.Lock()
	defer s.mu.Unlock()
	var msgs []bus.RawMsg
	want := make(map[types.UID]bool, len(pods))
	now := s.cfg.Now()
	nextSeen := make(map[types.UID]string)
	for _, p := range pods {
		want[p.UID] = true
		body := withoutSeen(p)
		prev, had := s.known[p.UID]
		seen, ok := s.seen[p.UID]
		if !ok {
			seen = now.UTC().Format(time.RFC3339Nano)
		}
		nextSeen[p.UID] = seen
		if had && bytes.Equal(prev, body) {
			continue
		}
		p.Annotations[ConfigFirstSeenAnnotationKey] = seen
		m, err := PodEventMsg(s.cfg.Node, events.UpsertAction(had), p, "", now)
		if err != nil {
			return err
		}
		msgs = append(msgs, m)
	}
	var gone []types.UID
	for uid, body := range s.known {
		if want[uid] {
			continue
		}
		gone = append(gone, uid)
		msgs = append(msgs, bus.PodEventRaw(s.cfg.Node, events.ActionDeleted, body, "", now))
	}
	if len(msgs) > 0 {
		if _, err := s.pub.PublishMsgs(ctx, msgs); err != nil {
			return fmt.Errorf("publish static pods: %w", err)
		}
		for _, p := range pods {
			s.known[p.UID] = withoutSeen(p)
		}
		for _, uid := range gone {
			delete(s.known, uid)
		}
		s.seen = nextSeen
		s.log.Info("static pods synced", "published", len(msgs), "pods", len(pods))
	}
	return readErr
}

// read parses the manifests as the kubelet's file source: a directory's files not starting with "." in
// name order (sub-directories are not read), or the one file. A manifest that cannot be read or parsed is
// logged and left out, so its pod is deleted, as with the kubelet. A missing path means no static pods.
func (s *StaticSource) read() ([]*v1.Pod, error) {
	st, err := os.Stat(s.cfg.ManifestPath)
	if err != nil {
		if os.IsNotExist(err) {
			return nil, fmt.Errorf("path does not exist, ignoring")
		}
		return nil, err
	}
	var files []string
	switch {
	case st.IsDir():
		files, err = filepath.Glob(filepath.Join(s.cfg.ManifestPath, "[^.]*"))
		if err != nil {
			return nil, fmt.Errorf("glob failed: %w", err)
		}
		sort.Strings(files)
	case st.Mode().IsRegular():
		files = []string{s.cfg.ManifestPath}
	default:
		return nil, fmt.Errorf("path is not a directory or file")
	}
	var pods []*v1.Pod
	uids := map[types.UID]string{}
	for _, f := range files {
		fi, err := os.Stat(f)
		if err != nil || !fi.Mode().IsRegular() {
			continue
		}
		p, err := readManifest(f, s.cfg.Node)
		if err != nil {
			s.log.Warn("could not process manifest file", "path", f, "err", err)
			continue
		}
		if other, dup := uids[p.UID]; dup {
			s.log.Warn("manifest duplicates another one", "path", f, "other", other, "pod_uid", p.UID)
			continue
		}
		uids[p.UID] = f
		pods = append(pods, p)
	}
	return pods, nil
}

// readManifest reads one static pod manifest (YAML or JSON) and applies the kubelet's file-source defaults:
// a UID when the manifest has none, the name suffixed with "-<node>", namespace "default", spec.nodeName,
// config.hash = UID, config.source = file, the NoExecute toleration of static pods, and phase Pending.
func readManifest(path, node string) (*v1.Pod, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	data, err := io.ReadAll(io.LimitReader(f, maxManifestBytes+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxManifestBytes {
		return nil, fmt.Errorf("%s: manifest is over %d bytes", path, maxManifestBytes)
	}
	return decodeManifest(data, path, node)
}

// maxManifestErrorBytes bounds the parser's part of a decodeManifest error: the reason is logged for every bad
// file at every resync, and a parser error can quote the input.
const maxManifestErrorBytes = 512

// decodeManifest decodes a static pod manifest read from path (see readManifest). Every error starts with
// path and says what is wrong.
func decodeManifest(data []byte, path, node string) (*v1.Pod, error) {
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil, fmt.Errorf("%s: couldn't parse as pod(%s), please check config file", path, truncate(err.Error()))
	}
	if bytes.Equal(bytes.TrimSpace(js), []byte("null")) {
		return nil, fmt.Errorf("%s: manifest is empty", path)
	}
	pod := &v1.Pod{}
	if err := json.Unmarshal(js, pod); err != nil {
		return nil, fmt.Errorf("%s: couldn't parse as pod(%s), please check config file", path, truncate(err.Error()))
	}
	if pod.Kind != "Pod" || (pod.APIVersion != "v1" && pod.APIVersion != "") {
		return nil, fmt.Errorf("%s: couldn't parse as pod(kind %q, apiVersion %q), please check config file", path,
			truncateTo(pod.Kind, 64), truncateTo(pod.APIVersion, 64))
	}
	if pod.Name == "" {
		return nil, fmt.Errorf("%s: invalid pod: name is needed for the pod", path)
	}
	if len(pod.Spec.Containers) == 0 {
		return nil, fmt.Errorf("%s: invalid pod: spec.containers: Required value", path)
	}
	if pod.UID == "" {
		pod.UID = staticUID(pod, path, node)
	}
	pod.Name = pod.Name + "-" + strings.ToLower(node)
	if pod.Namespace == "" {
		pod.Namespace = "default"
	}
	pod.Spec.NodeName = node
	if pod.Annotations == nil {
		pod.Annotations = map[string]string{}
	}
	pod.Annotations[ConfigHashAnnotationKey] = string(pod.UID)
	pod.Annotations[ConfigSourceAnnotationKey] = FileSource
	addNoExecuteToleration(pod)
	pod.Status.Phase = v1.PodPending
	if errs := validateStaticPod(pod); len(errs) > 0 {
		return nil, fmt.Errorf("%s: invalid pod: %s", path, truncate(fmt.Sprint(errs)))
	}
	return pod, nil
}

// truncate cuts s to maxManifestErrorBytes.
func truncate(s string) string { return truncateTo(s, maxManifestErrorBytes) }

// truncateTo cuts s to n bytes at a rune boundary, marking the cut with "...".
func truncateTo(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}

// staticUID is the kubelet's UID of a static pod read from a file: FNV-128a over the dump of the pod as
// decoded (k8s.io/kubernetes/pkg/util/hash.DeepHashObject), then "host:<node>" and "file:<path>", as hex.
// The kubelet dumps its internal API type after scheme defaulting, which imagefleet does not have, so the
// values differ from a real kubelet's, but they have the same properties: stable for an unchanged manifest
// on the same node and path, and new whenever the manifest changes.
func staticUID(pod *v1.Pod, path, node string) types.UID {
	h := fnv.New128a()
	fmt.Fprintf(h, "%v", dump.ForHash(pod))
	fmt.Fprintf(h, "host:%s", node)
	fmt.Fprintf(h, "file:%s", path)
	return types.UID(hex.EncodeToString(h.Sum(nil)))
}

// addNoExecuteToleration adds {operator: Exists, effect: NoExecute} unless an equal toleration exists.
func addNoExecuteToleration(pod *v1.Pod) {
	for _, t := range pod.Spec.Tolerations {
		if t.Operator == v1.TolerationOpExists && t.Effect == v1.TaintEffectNoExecute && t.Key == "" && t.TolerationSeconds == nil {
			return
		}
	}
	pod.Spec.Tolerations = append(pod.Spec.Tolerations, v1.Toleration{Operator: v1.TolerationOpExists, Effect: v1.TaintEffectNoExecute})
}

// withoutSeen is the pod's JSON without the config.seen annotation (what decides "updated").
func withoutSeen(p *v1.Pod) []byte {
	c := p.DeepCopy()
	delete(c.Annotations, ConfigFirstSeenAnnotationKey)
	b, _ := json.Marshal(c) // a decoded pod always marshals
	return b
}
