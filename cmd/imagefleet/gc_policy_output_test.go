package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/events"
)

// TestGCResultNamesItsImageGCPolicy: the text output of a pass names the ImageGCPolicy objects it applied and
// the policy that kept each image.
func TestGCResultNamesItsImageGCPolicy(t *testing.T) {
	var out bytes.Buffer
	cmd := &cobra.Command{}
	cmd.SetOut(&out)
	res := events.GCResult{Node: "n1", DryRun: true, Policies: []events.GCPolicySource{{Name: "builders", Generation: 3}, {Name: "all", Generation: 1}},
		Skipped: []events.GCSkipped{
			{ID: "sha256:aaaa", Why: "pinned by ImageGCPolicy", Policy: "builders"},
			{ID: "sha256:bbbb", Why: "kept: one of the last 2 tags of busybox (policy all)", Policy: "all"},
			{ID: "sha256:cccc", Why: "in use"},
		}}
	if err := printGCResult(cmd, res); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	for _, want := range []string{
		"policy: ImageGCPolicy builders/3,all/1 over the node's flags\n",
		"kept    pinned by ImageGCPolicy builders\n",
		"kept    kept: one of the last 2 tags of busybox (policy all)\n",
		"kept    in use\n",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("output lacks %q:\n%s", want, text)
		}
	}
}
