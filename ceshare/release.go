package ceshare

import (
	"context"
	"maps"
	"slices"
	"time"
)

// release forgets p and starts its release (startRelease); the channel closes when the release
// ends (nil when the member did not hold p).
func (m *Member) release(ctx context.Context, p int, why string) chan struct{} {
	m.mu.Lock()
	_, ok := m.parts[p]
	delete(m.parts, p)
	m.mu.Unlock()
	if !ok {
		return nil
	}
	return m.startRelease(ctx, p, why)
}

// startRelease calls Release for p in the background, bounded by ctx only (the member's run): a
// large share takes as long as its deletion takes, and one cut short would leave CEs another
// member owns in the store, where its confirmer and audits would still see them. A partition
// given back meanwhile waits for its release before it is acquired (readPartition). A member
// whose run has ended releases nothing: the store keeps p, and a restart that is not given it
// back releases it (Held). The channel returned closes when the release ends (nil when none
// started). A Release error is logged: the partition is not this member's any more whatever the
// store says.
func (m *Member) startRelease(ctx context.Context, p int, why string) chan struct{} {
	if ctx.Err() != nil {
		return nil
	}
	done := make(chan struct{})
	m.mu.Lock()
	if m.releasing[p] != nil {
		// Not reached: p is released again only once acquired again, after its release.
		m.mu.Unlock()
		m.log.Error("a CE partition's release started while another of it runs: not started", "partition", p)
		return nil
	}
	m.releasing[p] = done
	m.mu.Unlock()
	m.releases.Add(1)
	go func() {
		defer m.releases.Done()
		start := time.Now()
		err := m.hooks.Release(ctx, p)
		m.mu.Lock()
		if m.releasing[p] == done {
			delete(m.releasing, p)
		}
		m.mu.Unlock()
		close(done)
		switch {
		case err != nil && ctx.Err() != nil:
			m.log.Info("a CE partition's release stopped with the member: a restart not given it back releases it again",
				"partition", p, "why", why)
		case err != nil:
			m.log.Error("releasing a CE partition failed: its CEs that are left stay in the store until the replica restarts, "+
				"which releases them again (the partition is held from an earlier run)", "partition", p, "why", why, "err", err)
		default:
			m.log.Info("CE partition released", "partition", p, "why", why, "took", time.Since(start).Round(time.Millisecond))
		}
	}()
	return done
}

// awaitReleases waits for releases to end, ReleaseWait at most: the generation then takes up its
// partitions while the releases still running go on.
func (m *Member) awaitReleases(releases []chan struct{}) {
	deadline := time.After(m.cfg.ReleaseWait)
	for _, done := range releases {
		if done == nil {
			continue
		}
		select {
		case <-done:
		case <-deadline:
			m.mu.Lock()
			running := slices.Sorted(maps.Keys(m.releasing))
			m.mu.Unlock()
			m.log.Warn("CE partitions still being released: they go on in the background", "partitions", running, "waited", m.cfg.ReleaseWait)
			return
		}
	}
}

// forgetAll drops every partition without releasing it: the member stops.
func (m *Member) forgetAll() {
	m.mu.Lock()
	clear(m.parts)
	m.mu.Unlock()
	m.bal.setOwned(nil, 0)
}

func (m *Member) releaseAll(ctx context.Context, why string) {
	var releases []chan struct{}
	for _, p := range m.Owned() {
		releases = append(releases, m.release(ctx, p, why))
	}
	m.awaitReleases(releases)
	m.bal.setOwned(nil, 0)
}
