package ceshare

import (
	"testing"
	"time"
)

// A gap between two stamps longer than the session timeout less one heartbeat interval (the
// group may have evicted the member) reopens Settled, once: a member not settled yet, or whose
// stamps come on time, stays as it is.
func TestCheckPauseReopensSettled(t *testing.T) {
	const session, heartbeat = 3 * time.Second, 300 * time.Millisecond
	for _, tc := range []struct {
		name    string
		settled bool
		gaps    []time.Duration // between stamps, after the first
		want    bool            // Settled closed after the stamps
	}{
		{name: "stamps on time", settled: true, gaps: []time.Duration{pauseTick, pauseTick, 2 * time.Second}, want: true},
		{name: "a gap of the session less one heartbeat", settled: true, gaps: []time.Duration{session - heartbeat}, want: true},
		{name: "a gap past it", settled: true, gaps: []time.Duration{session - heartbeat + time.Millisecond}, want: false},
		{name: "a pause, then stamps on time", settled: true, gaps: []time.Duration{time.Minute, pauseTick, pauseTick}, want: false},
		{name: "a pause before the first generation settled", settled: false, gaps: []time.Duration{time.Minute}, want: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := &Member{cfg: MemberConfig{SessionTimeout: session, HeartbeatInterval: heartbeat}, log: testLog(t), settled: make(chan struct{})}
			if tc.settled {
				m.settle()
			}
			first := m.settled
			now := time.Now()
			m.checkPause(now)
			for _, g := range tc.gaps {
				now = now.Add(g)
				m.checkPause(now)
			}
			select {
			case <-m.settled:
				if !tc.want {
					t.Fatal("Settled is closed after the stamps")
				}
			default:
				if tc.want {
					t.Fatal("Settled is open after the stamps")
				}
			}
			if !tc.want && tc.settled && m.settled == first {
				t.Fatal("Settled returns the channel closed before the pause")
			}
		})
	}
}

// After a pause, the next generation's start settles (serve), and so does a stamp a session
// timeout later when the pause's generation is still the member's (the group did not evict it);
// a generation ended meanwhile settles nothing until the next one, and no stamp before the
// session timeout settles.
func TestSurvivedGenerationSettles(t *testing.T) {
	const session, heartbeat = 3 * time.Second, 300 * time.Millisecond
	for _, tc := range []struct {
		name      string
		now, then int32         // the member's generation at the pause and at the later stamp
		after     time.Duration // from the pause to the later stamp
		want      bool
	}{
		{name: "the same generation", now: 4, then: 4, after: session, want: true},
		{name: "the same generation, too soon", now: 4, then: 4, after: session - pauseTick, want: false},
		{name: "the generation ended", now: 4, then: 0, after: session, want: false},
		{name: "a later generation", now: 4, then: 6, after: session, want: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := &Member{cfg: MemberConfig{SessionTimeout: session, HeartbeatInterval: heartbeat}, log: testLog(t),
				settled: make(chan struct{}), generation: tc.now}
			m.settle()
			now := time.Now()
			m.checkPause(now)
			now = now.Add(time.Minute) // the pause
			m.checkPause(now)
			ch := m.settled
			m.generation = tc.then
			for end := now.Add(tc.after); now.Before(end); { // stamps on time until the later stamp
				now = now.Add(min(pauseTick, end.Sub(now)))
				m.checkPause(now)
			}
			select {
			case <-ch:
				if !tc.want {
					t.Fatal("settled")
				}
			default:
				if tc.want {
					t.Fatal("not settled")
				}
			}
		})
	}
}

// Settled reads MemberConfig.Now: a clock moved on past the session is a pause, as a process
// stopped that long finds time.Now moved on.
func TestSettledReadsTheConfiguredClock(t *testing.T) {
	now := time.Now()
	m := &Member{cfg: MemberConfig{SessionTimeout: 3 * time.Second, HeartbeatInterval: 300 * time.Millisecond, Now: func() time.Time { return now }},
		log: testLog(t), settled: make(chan struct{})}
	m.settle()
	select {
	case <-m.Settled():
	default:
		t.Fatal("Settled is open before the clock moved")
	}
	now = now.Add(time.Minute)
	select {
	case <-m.Settled():
		t.Fatal("Settled is closed after the clock moved on a minute")
	default:
	}
}
