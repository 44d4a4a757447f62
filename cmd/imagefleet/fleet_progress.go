package main

import (
	"fmt"
	"io"
	"os"
	"sync"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/imagefleet/imagefleet/services/fleet"
)

// rolloutProgress shows a rollout's progress on stderr: a progress bar on a terminal, plain lines
// otherwise (a batch as it starts, a node as it ends).
type rolloutProgress struct {
	w   io.Writer
	cfg fleet.RolloutConfig
	mu  sync.Mutex
	bar *progressbar.ProgressBar // nil: plain lines
}

func newRolloutProgress(errOut io.Writer, cfg fleet.RolloutConfig) *rolloutProgress {
	p := &rolloutProgress{w: errOut, cfg: cfg}
	if f, ok := errOut.(*os.File); ok && term.IsTerminal(int(f.Fd())) && len(cfg.Nodes) > 0 {
		p.bar = progressbar.NewOptions(len(cfg.Nodes), progressbar.OptionSetWriter(errOut),
			progressbar.OptionSetDescription(cfg.Kind+" "+cfg.ID), progressbar.OptionShowCount(),
			progressbar.OptionClearOnFinish(), progressbar.OptionSetPredictTime(false))
	}
	return p
}

// report is the rollout's RolloutConfig.Progress.
func (p *rolloutProgress) report(pr fleet.Progress) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.bar != nil && pr.Node != nil:
		_ = p.bar.Add(1)
	case p.bar != nil && pr.Batch != nil:
		p.bar.Describe(fmt.Sprintf("%s %s batch %d (%d nodes)", p.cfg.Kind, p.cfg.ID, pr.Batch.Index, pr.Batch.Size))
	case pr.Batch != nil:
		fmt.Fprintf(p.w, "batch %d: %d nodes\n", pr.Batch.Index, pr.Batch.Size)
	case pr.Node != nil:
		fmt.Fprintf(p.w, "[%d/%d] %s\n", pr.Done, pr.Total, nodeLine(*pr.Node))
	}
}

// finish clears the progress bar once the rollout has ended.
func (p *rolloutProgress) finish() {
	if p.bar != nil {
		_ = p.bar.Finish()
	}
}
