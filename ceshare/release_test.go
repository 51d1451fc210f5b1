package ceshare

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// releaseHooks is a ledger whose Release is release.
type releaseHooks struct {
	*ledger
	release func(ctx context.Context, p int) error
}

func (h *releaseHooks) Release(ctx context.Context, p int) error { return h.release(ctx, p) }

// logLines returns the lines of a text log at level or above that hold msg.
func logLines(log, msg string) []string {
	var out []string
	for line := range strings.Lines(log) {
		if strings.Contains(line, msg) {
			out = append(out, strings.TrimSpace(line))
		}
	}
	return out
}

// TestStartRelease pins a partition's release in the background: while Release runs, the
// partition is in Releasing, the channel returned is open and Run's wait for releases
// (Member.releases) waits; once it returns, all three end, and the outcome is logged: INFO when
// it released, ERROR when it failed (the doc's promise: the store keeps CEs until a restart),
// INFO when the member's run ended it. A member whose run has ended starts no release.
func TestStartRelease(t *testing.T) {
	for _, tc := range []struct {
		name string
		over bool  // the run ended before the release
		err  error // Release's error; context.Canceled: the run ends during it
		want string
	}{
		{name: "released", want: `level=INFO msg="CE partition released" partition=3 why=test`},
		{name: "failed", err: errors.New("disk full"), want: `level=ERROR msg="releasing a CE partition failed`},
		{name: "stopped with the member", err: context.Canceled, want: `level=INFO msg="a CE partition's release stopped with the member`},
		{name: "the run is over", over: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx, cancel := context.WithCancel(t.Context())
				defer cancel()
				if tc.over {
					cancel()
				}
				gate := make(chan struct{})
				var calls []int
				h := &releaseHooks{ledger: newLedger(), release: func(ctx context.Context, p int) error {
					calls = append(calls, p)
					select {
					case <-gate:
						return tc.err
					case <-ctx.Done():
						return ctx.Err()
					}
				}}
				var out bytes.Buffer
				m := &Member{hooks: h, log: slog.New(slog.NewTextHandler(&out, nil)), releasing: map[int]chan struct{}{}}
				done := m.startRelease(ctx, 3, "test")
				waited := make(chan struct{})
				go func() {
					m.releases.Wait()
					close(waited)
				}()
				synctest.Wait()
				if tc.over {
					<-waited
					if done != nil || len(calls) != 0 || len(m.Releasing()) != 0 || out.Len() != 0 {
						t.Errorf("a release after the run ended: channel %v, Release calls %v, releasing %v, logged %q",
							done, calls, m.Releasing(), out.String())
					}
					return
				}
				if done == nil || !slices.Equal(calls, []int{3}) || !slices.Equal(m.Releasing(), []int{3}) {
					t.Fatalf("release started: channel %v, Release calls %v, releasing %v; want a channel, [3], [3]", done, calls, m.Releasing())
				}
				select {
				case <-done:
					t.Fatal("the release's channel closed while Release runs")
				case <-waited:
					t.Fatal("the member's wait for its releases ended while Release runs")
				default:
				}
				if tc.err == context.Canceled {
					cancel()
				} else {
					close(gate)
				}
				<-waited
				select {
				case <-done:
				default:
					t.Error("the release's channel still open after Release returned")
				}
				if r := m.Releasing(); len(r) != 0 {
					t.Errorf("releasing %v after Release returned", r)
				}
				if lines := logLines(out.String(), "level="); len(lines) != 1 || !strings.Contains(lines[0], tc.want) {
					t.Errorf("logged %q; want one line with %s", lines, tc.want)
				}
			})
		})
	}
}

// TestAwaitReleases pins the wait of a generation for its releases: until each has ended, and
// ReleaseWait (10s) at most from the start of the wait, whatever the order they end in; a
// release not started (nil) is not waited for. A wait cut short says so at WARN, with the
// partitions still being released.
func TestAwaitReleases(t *testing.T) {
	const never = -1
	for _, tc := range []struct {
		name string
		ends map[int]time.Duration // per partition: when its release ends; 0: not started (nil); never
		want time.Duration         // how long the wait takes
		warn string                // the partitions of the WARN line; none when empty
	}{
		{name: "none started", ends: map[int]time.Duration{1: 0, 2: 0}, want: 0},
		{name: "all end in time", ends: map[int]time.Duration{1: 3 * time.Second, 2: 0, 3: 9 * time.Second}, want: 9 * time.Second},
		{name: "the last runs on", ends: map[int]time.Duration{4: 9 * time.Second, 7: never}, want: 10 * time.Second, warn: "[7]"},
		{name: "the first runs on", ends: map[int]time.Duration{2: never, 5: time.Second}, want: 10 * time.Second, warn: "[2]"},
		{name: "two run on", ends: map[int]time.Duration{2: never, 6: never}, want: 10 * time.Second, warn: `"[2 6]"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var out bytes.Buffer
				m := &Member{cfg: MemberConfig{ReleaseWait: 10 * time.Second}, log: slog.New(slog.NewTextHandler(&out, nil)),
					releasing: map[int]chan struct{}{}}
				var releases []chan struct{}
				for _, p := range slices.Sorted(maps.Keys(tc.ends)) {
					end := tc.ends[p]
					if end == 0 {
						releases = append(releases, nil)
						continue
					}
					done := make(chan struct{})
					releases = append(releases, done)
					m.mu.Lock()
					m.releasing[p] = done
					m.mu.Unlock()
					if end == never {
						defer close(done)
						continue
					}
					go func() {
						time.Sleep(end)
						m.mu.Lock()
						delete(m.releasing, p)
						m.mu.Unlock()
						close(done)
					}()
				}
				start := time.Now()
				m.awaitReleases(releases)
				if took := time.Since(start); took != tc.want {
					t.Errorf("waited %v; want %v", took, tc.want)
				}
				lines := logLines(out.String(), "level=WARN")
				switch {
				case tc.warn == "" && len(lines) > 0:
					t.Errorf("logged %q; want no WARN", lines)
				case tc.warn != "" && (len(lines) != 1 || !strings.Contains(lines[0], " partitions="+tc.warn+" ")):
					t.Errorf("logged %q; want one WARN line naming partitions %s", lines, tc.warn)
				}
			})
		})
	}
}

// TestReleaseAllAndForgetAll pins how a member lets go of all its partitions: evicted
// (releaseAll), it releases each, waits for the releases (ReleaseWait at most) and offers the
// group none; stopping (forgetAll), it releases none, holds none and offers the group none.
func TestReleaseAllAndForgetAll(t *testing.T) {
	for _, evicted := range []bool{true, false} {
		t.Run(map[bool]string{true: "evicted", false: "stopping"}[evicted], func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var mu sync.Mutex
				var calls []int
				h := &releaseHooks{ledger: newLedger(), release: func(_ context.Context, p int) error {
					mu.Lock()
					calls = append(calls, p)
					mu.Unlock()
					time.Sleep(3 * time.Second)
					return nil
				}}
				m := &Member{cfg: MemberConfig{ReleaseWait: 10 * time.Second}, hooks: h, log: testLog(t),
					parts: map[int]*partState{1: {}, 4: {}}, releasing: map[int]chan struct{}{},
					bal: &stickyBalancer{owned: []int{1, 4}}}
				start := time.Now()
				wantCalls, wantTook := []int{1, 4}, 3*time.Second
				if evicted {
					m.releaseAll(t.Context(), "test")
				} else {
					m.forgetAll()
					wantCalls, wantTook = nil, 0
				}
				took := time.Since(start)
				m.releases.Wait()
				slices.Sort(calls)
				if !slices.Equal(calls, wantCalls) || took != wantTook {
					t.Errorf("released %v, returning after %v; want %v after %v", calls, took, wantCalls, wantTook)
				}
				if o, a, r := m.Owned(), m.Assigned(), m.Releasing(); len(o) != 0 || len(a) != 0 || len(r) != 0 {
					t.Errorf("after: owned %v, offered %v, releasing %v; want none", o, a, r)
				}
			})
		})
	}
}
