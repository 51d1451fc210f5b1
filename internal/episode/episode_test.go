package episode

import (
	"errors"
	"testing"
	"time"
)

func TestEpisode(t *testing.T) {
	var e Episode
	t0 := time.Unix(1_800_000_000, 0)
	if since, err := e.State(); err != nil || !since.IsZero() {
		t.Fatalf("zero value: %v since %v, want no episode", err, since)
	}
	if took, n := e.Clear(t0); took != 0 || n != 0 {
		t.Fatalf("Clear with no episode: %v, %d", took, n)
	}
	first, second := errors.New("no space"), errors.New("still no space")
	if !e.Fail(first, t0) {
		t.Fatal("the first failure did not begin the episode")
	}
	if e.Fail(second, t0.Add(time.Second)) {
		t.Fatal("the second failure began another episode")
	}
	if since, err := e.State(); err != second || !since.Equal(t0) {
		t.Fatalf("State: %v since %v, want the last error since the first failure", err, since)
	}
	if took, n := e.Clear(t0.Add(3 * time.Second)); took != 3*time.Second || n != 2 {
		t.Fatalf("Clear: %v, %d attempts, want 3s and 2", took, n)
	}
	if _, err := e.State(); err != nil {
		t.Fatalf("State after Clear: %v", err)
	}
	if !e.Fail(first, t0.Add(time.Hour)) {
		t.Fatal("a failure after Clear did not begin a new episode")
	}
}

// TestEachEpisodeCountsItsOwnAttempts pins that Clear resets the count: a later episode reports
// only its own failed attempts, not those of the episodes before it.
func TestEachEpisodeCountsItsOwnAttempts(t *testing.T) {
	var e Episode
	t0 := time.Unix(1_800_000_000, 0)
	fail := errors.New("disk full")
	for i, attempts := range []int{3, 1, 2} {
		start := t0.Add(time.Duration(i) * time.Hour)
		for a := range attempts {
			e.Fail(fail, start.Add(time.Duration(a)*time.Second))
		}
		if took, n := e.Clear(start.Add(time.Minute)); took != time.Minute || n != attempts {
			t.Fatalf("episode %d: Clear = %v, %d attempts, want 1m0s and %d", i, took, n, attempts)
		}
	}
}
