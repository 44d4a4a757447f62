package controller

import (
	"errors"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
)

func mustTime(t *testing.T, s string) time.Time {
	t.Helper()
	v, err := time.Parse(time.RFC3339, s)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func mustSchedule(t *testing.T, expr, tz string, window time.Duration) schedule {
	t.Helper()
	spec := v1alpha1.ImageGCSpec{Schedule: expr, TimeZone: tz}
	if window > 0 {
		spec.Window = &metav1.Duration{Duration: window}
	}
	s, err := parseSchedule(spec, mustTime(t, "2026-01-01T00:00:00Z"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestParseScheduleRefuses: what a CronJob refuses, and what CEL cannot check, is refused with the
// Scheduled condition's reason and a message that says what to do.
func TestParseScheduleRefuses(t *testing.T) {
	for _, tc := range []struct {
		name, expr, tz, reason, msg string
	}{
		{"TZ inside", "TZ=Europe/Berlin 0 3 * * *", "", reasonInvalidSchedule, "use spec.timeZone"},
		{"CRON_TZ inside", "CRON_TZ=UTC @daily", "", reasonInvalidSchedule, "use spec.timeZone"},
		{"every", "@every 1h", "", reasonInvalidSchedule, "@every is not supported"},
		{"four fields", "0 3 * *", "", reasonInvalidSchedule, `schedule "0 3 * *": expected exactly 5 fields`},
		{"out of range", "61 * * * *", "", reasonInvalidSchedule, "above maximum (59)"},
		{"never", "0 0 30 2 *", "", reasonInvalidSchedule, "matches no time"},
		{"unknown zone", "@daily", "Mars/Olympus_Mons", reasonInvalidTimeZone, `timeZone "Mars/Olympus_Mons" is not a known IANA time zone`},
		{"local", "@daily", "Local", reasonInvalidTimeZone, "not Local"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseSchedule(v1alpha1.ImageGCSpec{Schedule: tc.expr, TimeZone: tc.tz}, mustTime(t, "2026-01-01T00:00:00Z"))
			var se *scheduleError
			if !errors.As(err, &se) || se.reason != tc.reason || !strings.Contains(se.msg, tc.msg) {
				t.Errorf("got %v, want %s containing %q", err, tc.reason, tc.msg)
			}
		})
	}
	for _, ok := range []string{"0 3 * * *", "*/15 * * * 1-5", "@hourly", "@daily", "@weekly", "@monthly", "@yearly"} {
		if _, err := parseSchedule(v1alpha1.ImageGCSpec{Schedule: ok}, mustTime(t, "2026-01-01T00:00:00Z")); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
}

// TestScheduleTimeZone: the schedule is read in its time zone, across the DST changes: 03:00 in New York is
// 08:00 UTC before the spring change and 07:00 after; a 02:30 that does not exist in Berlin (clocks jump from
// 02:00 to 03:00) does not fire that day, as a CronJob's; the default is UTC.
func TestScheduleTimeZone(t *testing.T) {
	for _, tc := range []struct {
		name, expr, tz, from string
		want                 []string
	}{
		{"UTC by default", "0 3 * * *", "", "2026-03-07T00:00:00Z", []string{"2026-03-07T03:00:00Z", "2026-03-08T03:00:00Z"}},
		{"New York spring forward", "0 3 * * *", "America/New_York", "2026-03-07T00:00:00Z",
			[]string{"2026-03-07T08:00:00Z", "2026-03-08T07:00:00Z", "2026-03-09T07:00:00Z"}},
		{"New York fall back", "0 3 * * *", "America/New_York", "2026-10-31T00:00:00Z",
			[]string{"2026-10-31T07:00:00Z", "2026-11-01T08:00:00Z"}},
		{"Berlin's missing 02:30", "30 2 * * *", "Europe/Berlin", "2026-03-28T00:00:00Z",
			[]string{"2026-03-28T01:30:00Z", "2026-03-30T00:30:00Z"}},
		{"Kolkata hourly", "@hourly", "Asia/Kolkata", "2026-01-01T00:00:00Z", []string{"2026-01-01T00:30:00Z", "2026-01-01T01:30:00Z"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := mustSchedule(t, tc.expr, tc.tz, 0)
			at := mustTime(t, tc.from)
			for _, w := range tc.want {
				at = s.cron.Next(at)
				if got := at.UTC().Format(time.RFC3339); got != w {
					t.Fatalf("next %s, want %s", got, w)
				}
			}
		})
	}
}

// TestDecide: which firing runs, which are skipped and counted, and when to look again.
func TestDecide(t *testing.T) {
	hourly := mustSchedule(t, "@hourly", "", 0)
	windowed := mustSchedule(t, "@hourly", "", 30*time.Minute)
	at := func(s string) time.Time { return mustTime(t, "2026-05-01T"+s+"Z") }
	for _, tc := range []struct {
		name        string
		s           schedule
		anchor, now time.Time
		held        bool
		fire        time.Time
		skipped     int
		lastSkipped time.Time
		waiting     time.Time
		next, wake  time.Time
	}{
		{name: "nothing due", s: hourly, anchor: at("10:05:00"), now: at("10:59:59"), next: at("11:00:00"), wake: at("11:00:00")},
		{name: "due: runs", s: hourly, anchor: at("10:05:00"), now: at("11:00:00"), fire: at("11:00:00"), next: at("12:00:00"), wake: at("12:00:00")},
		{name: "a firing is never run twice", s: hourly, anchor: at("11:00:00"), now: at("11:00:30"), next: at("12:00:00"), wake: at("12:00:00")},
		{name: "late within a minute: runs", s: hourly, anchor: at("10:05:00"), now: at("11:01:00"), fire: at("11:00:00"), next: at("12:00:00"), wake: at("12:00:00")},
		{name: "past a minute: skipped", s: hourly, anchor: at("10:05:00"), now: at("11:01:01"), skipped: 1, lastSkipped: at("11:00:00"),
			next: at("12:00:00"), wake: at("12:00:00")},
		{name: "held: waits until its deadline", s: hourly, anchor: at("10:00:00"), now: at("11:00:10"), held: true, waiting: at("11:00:00"),
			next: at("12:00:00"), wake: at("11:01:01")},
		{name: "missed firings: the latest runs within the window", s: windowed, anchor: at("07:00:00"), now: at("10:20:00"),
			fire: at("10:00:00"), skipped: 2, lastSkipped: at("09:00:00"), next: at("11:00:00"), wake: at("11:00:00")},
		{name: "missed firings: all past the window", s: windowed, anchor: at("07:00:00"), now: at("10:31:00"),
			skipped: 3, lastSkipped: at("10:00:00"), next: at("11:00:00"), wake: at("11:00:00")},
		{name: "an anchor after now (a clock behind the creation)", s: hourly, anchor: at("10:05:00"), now: at("09:59:00"),
			next: at("11:00:00"), wake: at("11:00:00")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := tc.s.decide(tc.anchor, tc.now, tc.held)
			if !d.Fire.Equal(tc.fire) || d.Skipped != tc.skipped || !d.LastSkipped.Equal(tc.lastSkipped) || !d.Waiting.Equal(tc.waiting) ||
				!d.Next.Equal(tc.next) || d.Capped || !d.Wake(tc.s).Equal(tc.wake) {
				t.Errorf("got %+v wake %v", d, d.Wake(tc.s))
			}
		})
	}
}

// TestDecideAfterLongOutage: a schedule of every minute after a year away counts a lower bound of the
// missed firings, at once, and still runs the latest one due.
func TestDecideAfterLongOutage(t *testing.T) {
	s := mustSchedule(t, "* * * * *", "", 0)
	anchor := mustTime(t, "2025-05-01T00:00:00Z")
	now := mustTime(t, "2026-05-01T00:00:30Z")
	began := time.Now()
	d := s.decide(anchor, now, false)
	if !d.Capped || d.Skipped < maxCounted || !d.Fire.Equal(mustTime(t, "2026-05-01T00:00:00Z")) || !d.LastSkipped.Before(d.Fire) {
		t.Errorf("got %+v", d)
	}
	if took := time.Since(began); took > 5*time.Second {
		t.Errorf("took %v", took)
	}
}

// TestWindowEnded: no wave starts once the window has passed since the firing's time; no window, no end.
func TestWindowEnded(t *testing.T) {
	fired := mustTime(t, "2026-05-01T03:00:00Z")
	for _, tc := range []struct {
		window time.Duration
		now    string
		want   bool
	}{
		{30 * time.Minute, "2026-05-01T03:29:59Z", false},
		{30 * time.Minute, "2026-05-01T03:30:00Z", true},
		{0, "2026-05-09T03:30:00Z", false},
	} {
		if got := windowEnded(fired, tc.window, mustTime(t, tc.now)); got != tc.want {
			t.Errorf("window %v at %s: %v, want %v", tc.window, tc.now, got, tc.want)
		}
	}
	if id := runID("u-1", fired); id != "gc-u-1-1777604400" {
		t.Errorf("run id %s", id)
	}
}
