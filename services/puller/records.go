package puller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// Image pull credential verification policies (KEP-2535, imagePullCredentialsVerificationPolicy).
const (
	NeverVerify                  = "NeverVerify"
	NeverVerifyPreloadedImages   = "NeverVerifyPreloadedImages"
	NeverVerifyAllowlistedImages = "NeverVerifyAllowlistedImages"
	AlwaysVerify                 = "AlwaysVerify"
)

// PullCredentials is what a pulled record says about who may use an image: the kubelet's
// ImagePullCredentials.
type PullCredentials struct {
	NodePodsAccessible        bool                   `json:"nodePodsAccessible,omitempty"`
	KubernetesSecrets         []RecordSecret         `json:"kubernetesSecrets,omitempty"`
	KubernetesServiceAccounts []RecordServiceAccount `json:"kubernetesServiceAccounts,omitempty"`
}

// RecordSecret is a secret whose credentials pulled an image.
type RecordSecret struct {
	UID            string `json:"uid"`
	Namespace      string `json:"namespace"`
	Name           string `json:"name"`
	CredentialHash string `json:"credentialHash"`
}

// RecordServiceAccount is a service account whose credentials pulled an image.
type RecordServiceAccount struct {
	UID       string `json:"uid"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
}

// PulledRecord is the KEP-2535 record of an image this node pulled: per image (without tag or digest),
// with which credentials.
type PulledRecord struct {
	ImageRef          string                     `json:"imageRef"`
	LastUpdated       time.Time                  `json:"lastUpdated"`
	CredentialMapping map[string]PullCredentials `json:"credentialMapping"`
}

// recordStore keeps pulled records and pull intents (an intent is written before a pull and removed after
// it, so an image whose pull was interrupted still counts as pulled by us).
type recordStore interface {
	GetRecord(ctx context.Context, imageRef string) (PulledRecord, bool, error)
	PutRecord(ctx context.Context, r PulledRecord) error
	HasIntent(ctx context.Context, image string) (bool, error)
	AddIntent(ctx context.Context, image string) error
	DoneIntent(ctx context.Context, image string) error
}

// podCredentials is the pod's side of the check: its secret and (first) service-account credentials.
type podCredentials struct {
	secrets        []RecordSecret
	serviceAccount *RecordServiceAccount
}

// pullManager is the kubelet's PullManager over a recordStore.
type pullManager struct {
	store     recordStore
	policy    string
	allowlist []string
	now       func() time.Time
	// checks is kubelet_imagemanager_image_mustpull_checks_total (nil: not counted).
	checks *prometheus.CounterVec
}

// imageWithoutTagOrDigest is the key of a credential mapping: the image as requested, without tag or digest.
func imageWithoutTagOrDigest(image string) string {
	repo, _, _, err := parseImageName(image)
	if err != nil {
		return image
	}
	// Keep the requested spelling (busybox stays busybox), only cut the tag/digest.
	s := image
	if i := strings.Index(s, "@"); i >= 0 {
		s = s[:i]
	}
	if i := strings.LastIndex(s, ":"); i > strings.LastIndex(s, "/") {
		s = s[:i]
	}
	if s == "" {
		return repo
	}
	return s
}

// Results of a must-pull check, the label of kubelet_imagemanager_image_mustpull_checks_total (the kubelet's
// pullmanager mustAttemptImagePullResult values).
const (
	checkCredentialPolicyAllowed = "credentialPolicyAllowed"
	checkCredentialRecordFound   = "credentialRecordFound"
	checkMustAuthenticate        = "mustAuthenticate"
	checkError                   = "error"

	// writeRecordWhileMatchingLimit is the kubelet's bound on a mapping's secrets below which a match by hash
	// or by coordinates also updates the record.
	writeRecordWhileMatchingLimit = 100
)

// mustAttemptImagePull decides whether an image present on the node must be pulled again for this pod's
// credentials, in the kubelet's PullManager.MustAttemptImagePull order, and counts the check's result in
// kubelet_imagemanager_image_mustpull_checks_total as the kubelet does (an empty imageRef is not counted).
// Any storage error answers true (fail safe: pull).
func (m *pullManager) mustAttemptImagePull(ctx context.Context, image, imageRef string, getCreds func() (podCredentials, error)) bool {
	if imageRef == "" {
		return true
	}
	must, result := m.mustPull(ctx, image, imageRef, getCreds)
	if m.checks != nil {
		m.checks.WithLabelValues(result).Inc()
	}
	return must
}

func (m *pullManager) mustPull(ctx context.Context, image, imageRef string, getCreds func() (podCredentials, error)) (bool, string) {
	rec, found, err := m.store.GetRecord(ctx, imageRef)
	if err != nil {
		return true, checkError
	}
	pulledByUs := found
	if !found {
		intent, err := m.store.HasIntent(ctx, image)
		if err != nil {
			return true, checkError
		}
		pulledByUs = intent
	}
	switch m.policy {
	case NeverVerify:
		return false, checkCredentialPolicyAllowed
	case NeverVerifyPreloadedImages:
		if !pulledByUs {
			return false, checkCredentialPolicyAllowed
		}
	case NeverVerifyAllowlistedImages:
		if m.allowlisted(image) {
			return false, checkCredentialPolicyAllowed
		}
	}
	if !found {
		return true, checkMustAuthenticate
	}
	key := imageWithoutTagOrDigest(image)
	mapping, ok := rec.CredentialMapping[key]
	if !ok {
		return true, checkMustAuthenticate
	}
	if mapping.NodePodsAccessible {
		return false, checkCredentialRecordFound
	}
	if len(mapping.KubernetesSecrets) == 0 && len(mapping.KubernetesServiceAccounts) == 0 {
		return true, checkMustAuthenticate
	}
	creds, err := getCreds()
	if err != nil {
		return true, checkError
	}
	for _, ps := range creds.secrets {
		for i, rs := range mapping.KubernetesSecrets {
			hashMatch := rs.CredentialHash != "" && ps.CredentialHash == rs.CredentialHash
			coordsMatch := ps.UID == rs.UID && ps.Namespace == rs.Namespace && ps.Name == rs.Name
			short := len(mapping.KubernetesSecrets) < writeRecordWhileMatchingLimit
			// As the kubelet: equal hashes match; equal coordinates with another hash match only while the
			// list is short (the record is then updated to the pod's secret).
			if !hashMatch && !(coordsMatch && short) {
				continue
			}
			// Keep the record current (the kubelet does so while the list is short).
			if rs != ps && short {
				mapping.KubernetesSecrets[i] = ps
				if hashMatch && !coordsMatch {
					mapping.KubernetesSecrets = append(mapping.KubernetesSecrets, rs)
				}
				rec.CredentialMapping[key] = mapping
				rec.LastUpdated = m.now()
				_ = m.store.PutRecord(ctx, rec)
			}
			return false, checkCredentialRecordFound
		}
	}
	if sa := creds.serviceAccount; sa != nil && slices.Contains(mapping.KubernetesServiceAccounts, *sa) {
		return false, checkCredentialRecordFound
	}
	return true, checkMustAuthenticate
}

func (m *pullManager) allowlisted(image string) bool {
	repo, _, _, err := parseImageName(image)
	if err != nil {
		return false
	}
	for _, a := range m.allowlist {
		if p, ok := strings.CutSuffix(a, "/*"); ok {
			if strings.HasPrefix(repo, p+"/") {
				return true
			}
		} else if repo == a {
			return true
		}
	}
	return false
}

// recordImagePulled merges the credentials that pulled image into its record (nil or a node credential:
// accessible to every pod on the node).
func (m *pullManager) recordImagePulled(ctx context.Context, image, imageRef string, used *Credential) error {
	rec, found, err := m.store.GetRecord(ctx, imageRef)
	if err != nil {
		return err
	}
	if !found {
		rec = PulledRecord{ImageRef: imageRef}
	}
	if rec.CredentialMapping == nil {
		rec.CredentialMapping = map[string]PullCredentials{}
	}
	key := imageWithoutTagOrDigest(image)
	pc := rec.CredentialMapping[key]
	switch {
	case used == nil || (used.Secret == nil && used.ServiceAccount == nil):
		pc = PullCredentials{NodePodsAccessible: true}
	case used.Secret != nil:
		s := RecordSecret{UID: used.Secret.UID, Namespace: used.Secret.Namespace, Name: used.Secret.Name, CredentialHash: used.Hash}
		if !pc.NodePodsAccessible && !slices.Contains(pc.KubernetesSecrets, s) {
			pc.KubernetesSecrets = append(pc.KubernetesSecrets, s)
		}
	case used.ServiceAccount != nil:
		sa := RecordServiceAccount{UID: used.ServiceAccount.UID, Namespace: used.ServiceAccount.Namespace, Name: used.ServiceAccount.Name}
		if !pc.NodePodsAccessible && !slices.Contains(pc.KubernetesServiceAccounts, sa) {
			pc.KubernetesServiceAccounts = append(pc.KubernetesServiceAccounts, sa)
		}
	}
	rec.CredentialMapping[key] = pc
	rec.LastUpdated = m.now()
	if err := m.store.PutRecord(ctx, rec); err != nil {
		return err
	}
	return m.store.DoneIntent(ctx, image)
}

// memRecords is an in-memory recordStore.
type memRecords struct {
	mu      sync.Mutex
	records map[string]PulledRecord
	intents map[string]int
}

func newMemRecords() *memRecords {
	return &memRecords{records: map[string]PulledRecord{}, intents: map[string]int{}}
}

func (s *memRecords) GetRecord(_ context.Context, ref string) (PulledRecord, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.records[ref]
	return cloneRecord(r), ok, nil
}

func (s *memRecords) PutRecord(_ context.Context, r PulledRecord) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.records[r.ImageRef] = cloneRecord(r)
	return nil
}

func (s *memRecords) HasIntent(_ context.Context, image string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.intents[image] > 0, nil
}

func (s *memRecords) AddIntent(_ context.Context, image string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.intents[image]++
	return nil
}

func (s *memRecords) DoneIntent(_ context.Context, image string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.intents[image] <= 1 {
		delete(s.intents, image)
	} else {
		s.intents[image]--
	}
	return nil
}

func cloneRecord(r PulledRecord) PulledRecord {
	raw, _ := json.Marshal(r)
	var out PulledRecord
	_ = json.Unmarshal(raw, &out)
	return out
}

// kvRecords keeps records in events.PullRecordsBucket, pulled records (<node>.rec.<sha256 of imageRef>) and
// pull intents (<node>.intent.<sha256 of image>): they survive restarts and are shared by the node's replicas.
// It also keeps the riders records of the node's pull requests (<node>.riders.<sha256 of request id>,
// riders.go), in the node's keys of the same bucket, which the node may write.
type kvRecords struct {
	kv   *bus.KV
	node string
}

func openKVRecords(ctx context.Context, b *bus.Bus, node string) (*kvRecords, error) {
	kv, err := b.KV(ctx, bus.KVConfig{Bucket: events.PullRecordsBucket, Description: "KEP-2535 image pulled records and pull intents"})
	if err != nil {
		return nil, err
	}
	return &kvRecords{kv: kv, node: node}, nil
}

func (s *kvRecords) recKey(ref string) string {
	return events.NodeToken(s.node) + ".rec." + hashKey(ref)
}
func (s *kvRecords) intentKey(image string) string {
	return events.NodeToken(s.node) + ".intent." + hashKey(image)
}

func (s *kvRecords) GetRecord(ctx context.Context, ref string) (PulledRecord, bool, error) {
	v, _, err := s.kv.Get(ctx, s.recKey(ref))
	if errors.Is(err, bus.ErrKeyNotFound) {
		return PulledRecord{}, false, nil
	}
	if err != nil {
		return PulledRecord{}, false, err
	}
	var r PulledRecord
	if err := json.Unmarshal(v, &r); err != nil {
		return PulledRecord{}, false, fmt.Errorf("decode pulled record: %w", err)
	}
	return r, true, nil
}

func (s *kvRecords) PutRecord(ctx context.Context, r PulledRecord) error {
	v, err := json.Marshal(r)
	if err != nil {
		return err
	}
	_, err = s.kv.Put(ctx, s.recKey(r.ImageRef), v)
	return err
}

func (s *kvRecords) HasIntent(ctx context.Context, image string) (bool, error) {
	_, _, err := s.kv.Get(ctx, s.intentKey(image))
	if errors.Is(err, bus.ErrKeyNotFound) {
		return false, nil
	}
	return err == nil, err
}

// AddIntent marks the image as being pulled. Concurrent pulls of one image share the key (single-flight
// makes them one pull per credential set); the intent outlives a crash, as the kubelet's file does.
func (s *kvRecords) AddIntent(ctx context.Context, image string) error {
	_, err := s.kv.Put(ctx, s.intentKey(image), []byte(image))
	return err
}

func (s *kvRecords) DoneIntent(ctx context.Context, image string) error {
	return s.kv.Delete(ctx, s.intentKey(image))
}

func (s *kvRecords) ridersKey(requestID string) string {
	return events.NodeToken(s.node) + ".riders." + hashKey(requestID)
}

// ridersRecord is the stored form of a riders record.
type ridersRecord struct {
	Riders []rider `json:"riders"`
}

// Riders returns the requests recorded as riding on request requestID's message (none: nil).
func (s *kvRecords) Riders(ctx context.Context, requestID string) ([]rider, error) {
	v, _, err := s.kv.Get(ctx, s.ridersKey(requestID))
	if errors.Is(err, bus.ErrKeyNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var r ridersRecord
	if err := json.Unmarshal(v, &r); err != nil {
		return nil, fmt.Errorf("decode riders record: %w", err)
	}
	return r.Riders, nil
}

// PutRiders replaces the riders record of request requestID's message; none removes it.
func (s *kvRecords) PutRiders(ctx context.Context, requestID string, riders []rider) error {
	if len(riders) == 0 {
		return s.kv.Delete(ctx, s.ridersKey(requestID))
	}
	v, err := json.Marshal(ridersRecord{Riders: riders})
	if err != nil {
		return err
	}
	_, err = s.kv.Put(ctx, s.ridersKey(requestID), v)
	return err
}
