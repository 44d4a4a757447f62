package controller

import (
	"fmt"
	"strings"
	"time"
	_ "time/tzdata" // spec.timeZone is read from the binary's own copy: a distroless image has no zoneinfo

	"github.com/robfig/cron/v3"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
)

// This file is a scheduled ImageGC's pure logic: which firing runs now, which are skipped, when a run's
// window ends. It reads no clock: the caller passes now.

// noWindowDeadline is how late a firing may still start when the object has no window.
const noWindowDeadline = time.Minute

// maxCounted bounds the firings counted one by one after a long outage (a schedule of every minute over a
// year is half a million): past it, the count is a lower bound.
const maxCounted = 10000

// schedule is a valid spec.schedule read in its time zone.
type schedule struct {
	cron   cron.Schedule
	loc    *time.Location
	window time.Duration // 0: none
}

// Reasons of the Scheduled condition when the schedule cannot be used.
const (
	reasonInvalidSchedule = "InvalidSchedule"
	reasonInvalidTimeZone = "InvalidTimeZone"
)

// scheduleError is a schedule the controller cannot use: the reason of the Scheduled condition and the
// message to show.
type scheduleError struct {
	reason, msg string
}

func (e *scheduleError) Error() string { return e.msg }

// parseSchedule reads spec's schedule as the CronJob controller does (robfig/cron's standard parser, the
// time zone given to it as CRON_TZ), refusing what a CronJob refuses: a time zone inside the schedule,
// Local, and @every (no fixed times to count firings by). A schedule that matches no time (Feb 30) is
// refused too. now is only used to look for a next firing.
func parseSchedule(spec v1alpha1.ImageGCSpec, now time.Time) (schedule, error) {
	expr := strings.TrimSpace(spec.Schedule)
	if strings.Contains(expr, "TZ") {
		return schedule{}, &scheduleError{reasonInvalidSchedule, fmt.Sprintf("schedule %q sets a time zone (TZ= or CRON_TZ=): use spec.timeZone", spec.Schedule)}
	}
	if strings.HasPrefix(expr, "@every") {
		return schedule{}, &scheduleError{reasonInvalidSchedule, fmt.Sprintf("schedule %q: @every is not supported; use 5 fields or @hourly, @daily, @weekly, @monthly, @yearly", spec.Schedule)}
	}
	tz := spec.TimeZone
	if tz == "" {
		tz = "UTC"
	}
	if tz == "Local" {
		return schedule{}, &scheduleError{reasonInvalidTimeZone, "timeZone must name a time zone, not Local"}
	}
	loc, err := time.LoadLocation(tz)
	if err != nil {
		return schedule{}, &scheduleError{reasonInvalidTimeZone, fmt.Sprintf("timeZone %q is not a known IANA time zone: %v", tz, err)}
	}
	c, err := cron.ParseStandard("CRON_TZ=" + tz + " " + expr)
	if err != nil {
		return schedule{}, &scheduleError{reasonInvalidSchedule, fmt.Sprintf("schedule %q: %v", spec.Schedule, err)}
	}
	if c.Next(now).IsZero() {
		return schedule{}, &scheduleError{reasonInvalidSchedule, fmt.Sprintf("schedule %q matches no time", spec.Schedule)}
	}
	s := schedule{cron: c, loc: loc}
	if spec.Window != nil {
		s.window = spec.Window.Duration
	}
	return s, nil
}

// deadline is how late after its time a firing may still start its run: the window, or 1m without one.
func (s schedule) deadline() time.Duration {
	if s.window > 0 {
		return s.window
	}
	return noWindowDeadline
}

// decision is what a scheduled object does at one moment.
type decision struct {
	// Fire is the firing whose run starts now (zero: none).
	Fire time.Time
	// Skipped counts the firings given up since the anchor: each one older than a later due firing, and
	// a due firing past its deadline. LastSkipped is the latest of them; Capped says the count is a lower
	// bound (more than maxCounted).
	Skipped     int
	LastSkipped time.Time
	Capped      bool
	// Waiting is a due firing held back (a run is going, or the object is paused): it starts when nothing
	// holds it any more, if that is before its deadline.
	Waiting time.Time
	// Next is the first firing after now.
	Next time.Time
}

// Wake is when the object must be looked at again: its next firing, or a waiting firing's deadline.
func (d decision) Wake(s schedule) time.Time {
	if !d.Waiting.IsZero() {
		if end := d.Waiting.Add(s.deadline()); end.Before(d.Next) {
			return end.Add(time.Second)
		}
	}
	return d.Next
}

// decide looks at the firings after anchor (the latest run's firing, the latest firing already given up,
// or the object's creation) up to now. The latest due one runs if nothing holds it (held: a run is going
// or the object is paused, concurrencyPolicy Forbid and suspend) and its deadline has not passed; every
// earlier one is skipped, as a CronJob runs only the most recent missed schedule. At most once per firing:
// a firing at or before anchor is never looked at again.
func (s schedule) decide(anchor, now time.Time, held bool) decision {
	var d decision
	var latest time.Time
	for t := s.cron.Next(anchor); !t.IsZero() && !t.After(now); t = s.cron.Next(t) {
		if !latest.IsZero() {
			d.Skipped++
			d.LastSkipped = latest
		}
		latest = t
		if !d.Capped && d.Skipped >= maxCounted && now.Sub(t) > s.deadline() {
			// A long outage: jump to the deadline's start; the firings in between are skipped, uncounted.
			d.Capped = true
			d.LastSkipped = latest
			latest = time.Time{}
			t = now.Add(-s.deadline() - time.Second)
		}
	}
	if !latest.IsZero() {
		switch {
		case now.Sub(latest) > s.deadline():
			d.Skipped++
			d.LastSkipped = latest
		case held:
			d.Waiting = latest
		default:
			d.Fire = latest
		}
	}
	d.Next = s.cron.Next(laterOf(anchor, now))
	return d
}

// windowEnded reports whether a run of the firing at fired may start no more waves at now.
func windowEnded(fired time.Time, window time.Duration, now time.Time) bool {
	return window > 0 && !now.Before(fired.Add(window))
}

// runID is the rollout id of the firing at t: gc-<uid>-<unix seconds>, so a controller that restarts
// resumes the firing's rollout.
func runID(uid string, t time.Time) string {
	return fmt.Sprintf("gc-%s-%d", uid, t.Unix())
}

func laterOf(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
