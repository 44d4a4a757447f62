package main_test

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
)

// TestAgentWritesEventVersionV2: the agent binary with --event-version v2 (its journal on, the default)
// stores its events as v2: the ce-type's version, the payload alone as the body, the envelope in the
// extension headers; `imagefleet events` reads them back.
func TestAgentWritesEventVersionV2(t *testing.T) {
	rt := hollow.New(hollow.Options{Name: "cli-v2"})
	img, _ := rt.AddImage(cri.Image{RepoTags: []string{"docker.io/library/busybox:1.36"}, Size: 100})
	dir := t.TempDir()
	endpoint, stop, err := rt.StartUnix(t.Context(), filepath.Join(dir, "cri.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	const node = "node-v2.cli"
	port := freePort(t)
	natsURL := fmt.Sprintf("nats://127.0.0.1:%d", port)
	startAgent(t, "--node", node, "--cri", endpoint, "--embedded-nats", fmt.Sprintf("127.0.0.1:%d", port),
		"--data-dir", filepath.Join(dir, "data"), "--workers", "detector", "--event-version", "v2")
	bustest.Eventually(t, "detect", pollTimeout, func() error {
		if _, errOut, code := run(t, "detect", "--node", node, "--nats", natsURL, "--timeout", "2s"); code != 0 {
			return fmt.Errorf("exit %d: %s", code, errOut)
		}
		return nil
	})
	b, err := bus.Connect(t.Context(), natsURL, bus.Options{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	var stored []bus.StreamMsg
	bustest.Eventually(t, "the detected event stored", pollTimeout, func() error {
		stored = stored[:0]
		err := b.Read(t.Context(), events.EventsStream, events.EventSubject(node, events.EntityImage, events.ActionDetected),
			func(m bus.StreamMsg) error { stored = append(stored, m); return nil })
		if err == nil && len(stored) == 0 {
			err = fmt.Errorf("none yet")
		}
		return err
	})
	m := stored[0]
	if got := m.Header.Get(events.HeaderType); got != "imagefleet.image.detected.v2" {
		t.Fatalf("ce-type %q, want imagefleet.image.detected.v2", got)
	}
	if m.Header.Get(events.HeaderNode) != node || m.Header.Get(events.HeaderDataContentType) != "application/json" {
		t.Errorf("headers %v: want ce-node %s and ce-datacontenttype", m.Header, node)
	}
	var rec events.ImageRecord
	dec := json.NewDecoder(strings.NewReader(string(m.Data)))
	dec.DisallowUnknownFields() // the payload alone: no envelope field
	if err := dec.Decode(&rec); err != nil || rec.ID != img.ID {
		t.Fatalf("body %s: %v, want the image record of %s alone", m.Data, err, img.ID)
	}
	out, errOut, code := run(t, "events", "--nats", natsURL, "--node", node, "--type", "image.detected", "-o", "json")
	if code != 0 {
		t.Fatalf("events: exit %d: %s", code, errOut)
	}
	ev, err := events.DecodeEvent([]byte(strings.SplitN(strings.TrimSpace(out), "\n", 2)[0]))
	if err != nil || ev.Type != "imagefleet.image.detected.v2" || ev.Node != node {
		t.Fatalf("events printed %q: %+v, %v", out, ev, err)
	}
}
