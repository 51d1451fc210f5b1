package replica

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/stream"
)

// Join opens the posterior log on conn and sets the current posterior from it: the ledger's,
// checked against the log when this replica followed it before; else the log's genesis, appended
// by this replica first when the log is empty (the first valid genesis wins, whoever wrote it).
// A replica whose cluster-wide settings differ from the genesis's returns a *SettingsError. Join
// may be called again after it failed (a broker that could not be reached): it opens the log again.
func (r *Replica) Join(ctx context.Context, conn stream.ConnConfig) error {
	r.conn = conn
	if r.plog != nil {
		r.plog.Close()
		r.plog = nil
	}
	var err error
	if r.settings, err = ClusterSettings(r.cfg); err != nil {
		return err
	}
	if r.plog, err = postlog.Open(ctx, r.conn, r.cfg.Replication.PosteriorTopic, r.keys, r.lg); err != nil {
		return err
	}
	stored, err := r.ledger.LogHead()
	if err != nil {
		return err
	}
	head, err := postlog.UnmarshalHead(stored)
	if err != nil {
		return fmt.Errorf("%w (the ledger %s is damaged: move state_dir aside and the replica rebuilds from Kafka)", err, r.ledger.Path())
	}
	if head != nil {
		m, err := r.ledger.Current()
		if err != nil {
			return err
		}
		if err := r.checkHead(ctx, head); err != nil {
			return err
		}
		g, at, err := r.genesisOf(ctx, head)
		if err != nil {
			return err
		}
		if err := r.checkSettings(g, at); err != nil {
			return err
		}
		r.chain, r.read = postlog.Resume(head, r.keys), head.Offset+1
		r.host.SetCurrent(m)
		r.remember(m)
		r.mu.Lock()
		r.resumed = true
		r.mu.Unlock()
		r.lg.Info("following the posterior log", "topic", r.plog.Topic(), "entry", head.Seq, "term", head.Term,
			"posterior_version", head.Version, "posterior_sha256", head.PosteriorSHA256)
		return nil
	}
	if _, err := r.ledger.Current(); err == nil {
		return fmt.Errorf("state_dir %s holds the ledger of a single daemon (%s), which a replica does not follow: "+
			"start the replica with an empty state_dir, or set replication.enabled: false", r.cfg.StateDir, r.ledger.Path())
	} else if !errors.Is(err, ledger.ErrNoPosterior) {
		return err
	}
	return r.genesis(ctx)
}

// checkHead verifies that the entry the ledger applied last is still in the log, at its offset
// with its bytes: a log that lost it (a recreated topic, an unclean election) would otherwise be
// followed from another history.
func (r *Replica) checkHead(ctx context.Context, head *postlog.Head) error {
	end, err := r.plog.End(ctx)
	if err != nil {
		return err
	}
	if end <= head.Offset { // no record to wait for: the log ends before it
		return r.resetError(head, fmt.Sprintf("the topic ends at offset %d", end))
	}
	rd, err := r.plog.Read(head.Offset)
	if err != nil {
		return err
	}
	defer rd.Close()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	rec, err := rd.Next(cctx)
	if err == nil && rec.Offset == head.Offset && hashHex(rec.Value) == head.Hash {
		if aerr := postlog.Authenticate(r.keys, rec); aerr != nil {
			return fmt.Errorf("the entry the ledger %s applied last (offset %d of replication.posterior_topic %s) does not authenticate "+
				"under the keys of replication.key_file %s (%w): this is not the key file the cluster uses. Give this replica the cluster's "+
				"key file (keep every key that signed entries the log still holds); the ledger was not changed",
				r.ledger.Path(), head.Offset, r.plog.Topic(), r.keys.Source(), aerr)
		}
		return nil
	}
	found := "no record"
	if err == nil {
		found = fmt.Sprintf("the record at offset %d hashes to %s", rec.Offset, hashHex(rec.Value))
	} else if ctx.Err() == nil {
		found = err.Error()
	}
	return r.resetError(head, found)
}

// resetError is checkHead's refusal: the log no longer holds head, the entry the ledger applied
// last (found says what is there instead).
func (r *Replica) resetError(head *postlog.Head, found string) error {
	return fmt.Errorf("posterior log reset: the ledger %s applied entry %d (offset %d, sha256 %s) of replication.posterior_topic %s, "+
		"and the topic no longer holds it (%s). The ledger was not changed. Once a new epoch gives the log a start again (cfguard "+
		"new-epoch --head-from, docs/RUNBOOK.md, CfguardPosteriorLogStopped), move state_dir aside and restart: the replica rebuilds "+
		"from it", r.ledger.Path(), head.Seq, head.Offset, head.Hash, r.plog.Topic(), found)
}

func hashHex(v []byte) string {
	h := postlog.Hash(v)
	return hex.EncodeToString(h[:])
}

// noLiveUpdaters fails when the updater group has members: replicas that run on a log this
// replica does not see (it was deleted and recreated, or emptied), which only a new epoch from
// one of their heads may start again. Members are waited out for a session timeout first (a
// process of this replica's, killed, stays a member that long). A group that cannot be described
// is asked again while the error is one a retry fixes (a coordinator not ready on a new cluster).
func (r *Replica) noLiveUpdaters(ctx context.Context) error {
	tr, err := r.conn.Transport(ctx)
	if err != nil {
		return err
	}
	defer tr.CloseIdleConnections()
	cl := &kafka.Client{Addr: kafka.TCP(r.conn.Brokers...), Transport: tr}
	bo := backoff.Backoff{Min: 100 * time.Millisecond, Max: 2 * time.Second}
	deadline := time.Now().Add(r.cfg.Replication.SessionTimeout + 5*time.Second)
	for {
		res, err := cl.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{r.group}})
		if err == nil && len(res.Groups) == 1 {
			err = res.Groups[0].Error
		}
		var members []string
		switch {
		case errors.Is(err, kafka.GroupIdNotFound):
			return nil // a new cluster's group, not created yet
		case err == nil && (len(res.Groups) != 1 || len(res.Groups[0].Members) == 0):
			return nil
		case err == nil:
			for _, m := range res.Groups[0].Members {
				members = append(members, m.ClientHost)
			}
			if end, eerr := r.plog.End(ctx); eerr == nil && end > 0 {
				return errLogGrew // a genesis landed meanwhile: the caller reads it
			}
		case ctx.Err() != nil:
			return ctx.Err()
		case !stream.Retryable(err):
			hint := ""
			if errors.Is(err, kafka.GroupAuthorizationFailed) {
				hint = "; the replicas' principal needs Describe on it"
			}
			return fmt.Errorf("replication.posterior_topic %s is empty, and whether replicas run on it cannot be told (describing the "+
				"group %s: %w%s): nothing was written", r.plog.Topic(), r.group, err, hint)
		}
		if time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("replication.posterior_topic %s is empty, and whether replicas run on it cannot be told (describing the "+
					"group %s: %w): nothing was written; retry", r.plog.Topic(), r.group, err)
			}
			return fmt.Errorf("replication.posterior_topic %s is empty, but %d replicas run in the updater group %s (hosts %s, still there "+
				"after replication.session_timeout): either this replica's replication.posterior_topic is not the topic they follow "+
				"(every replica names the same: compare the configuration files; this start created %s if it did not exist), or "+
				"the log they follow was deleted or emptied under them, and a genesis of this "+
				"replica's would start a second history beside theirs; nothing was written: a new log starts from one of their heads "+
				"(cfguard new-epoch --head-from <a running replica's URL>, see docs/RUNBOOK.md, CfguardPosteriorLogStopped), then start "+
				"this replica again", r.plog.Topic(), len(members), r.group, strings.Join(members, ", "), r.plog.Topic())
		}
		if err := bo.Wait(ctx); err != nil {
			return err
		}
	}
}

// errLogGrew: the posterior log, empty when looked at, holds records now.
var errLogGrew = errors.New("the posterior log grew meanwhile")

// appendGenesis appends a genesis of this replica's first posterior (Host.InitialModel) to the
// log.
func (r *Replica) appendGenesis(ctx context.Context) error {
	m, err := r.host.InitialModel(ctx)
	if err != nil {
		return err
	}
	e, err := postlog.NewGenesis(m, r.writer, r.settings)
	if err != nil {
		return err
	}
	v, err := e.Encode()
	if err != nil {
		return err
	}
	if err := r.plog.Append(ctx, "genesis", v); err != nil {
		return err
	}
	r.lg.Info("posterior log empty: genesis appended", "posterior_sha256", e.PosteriorSHA256, "bytes", len(v))
	return nil
}

// genesis finds the log's genesis, appending one from this replica's first posterior when the
// log has none, and checkpoints the accepted one as the ledger's first posterior.
func (r *Replica) genesis(ctx context.Context) error {
	end, err := r.plog.End(ctx)
	if err != nil {
		return err
	}
	rd, err := r.plog.Read(0)
	if err != nil {
		return err
	}
	defer rd.Close()
	chain := postlog.NewChain(r.keys)
	awaited := false                   // a genesis was appended: read on until one is accepted
	authentic, forged := 0, 0          // records below end that authenticate, and that do not
	var unknown clusterkey.UnknownKeys // records below end signed under key ids not in this replica's file
	for next := int64(0); ; {
		if next >= end && !awaited && forged > 0 && authentic == 0 {
			// A replica with another key would otherwise write a genesis of its own, accept it
			// alone, and follow a log no other replica follows.
			return fmt.Errorf("replication.posterior_topic %s holds %d records and none authenticates under the keys of replication.key_file %s (%s): "+
				"this replica's key file is not the cluster's (give it the same file as the other replicas), or the records were written by someone "+
				"without the key (check the topic's ACLs: only the replicas' principal may write it; if the log holds no entry of this cluster, "+
				"delete the topic and start the replicas again)", r.plog.Topic(), forged, r.keys.Source(), strings.Join(r.keys.IDs(), ", "))
		}
		if next >= end && !awaited && authentic > 0 && unknown.Records > 0 {
			// Entries under this file's keys, and records under keys it does not hold: most
			// likely the log's start is signed with a key rotated out of this file too early.
			return fmt.Errorf("replication.posterior_topic %s holds %d entries that authenticate under replication.key_file %s (%s) and %d records "+
				"signed under key ids it does not hold (%s), and no genesis it can read: if those are the cluster's (a key rotated out of the "+
				"file while the log holds entries signed with it), give this replica the cluster's key file with every key the log was "+
				"signed with (docs/DEPLOY.md, \"The cluster key\"); if no replica holds them, the topic lost its start "+
				"(docs/RUNBOOK.md, CfguardPosteriorLogStopped); nothing was written",
				r.plog.Topic(), authentic, r.keys.Source(), strings.Join(r.keys.IDs(), ", "), unknown.Records, &unknown)
		}
		if next >= end && !awaited && authentic > 0 {
			// Entries of this cluster and no genesis: the log lost its start. A genesis of this
			// replica's own would be accepted by it alone: a replica that serves another history.
			return fmt.Errorf("replication.posterior_topic %s holds %d entries of this cluster (they authenticate under replication.key_file %s) "+
				"and no genesis: the topic lost its start (it was deleted and recreated while replicas wrote to it, or records were deleted), "+
				"and a replica cannot start from it: a new epoch written from a replica's head gives it a start (cfguard new-epoch "+
				"--head-from <a running replica's URL> when the replicas stopped on the reset, --force when they follow), "+
				"see docs/RUNBOOK.md, CfguardPosteriorLogStopped; nothing was written",
				r.plog.Topic(), authentic, r.keys.Source())
		}
		if next >= end && !awaited {
			// No entry at all. A new cluster's, or a log deleted under running replicas: those
			// are members of the updater group, and a genesis of this replica's would start a
			// second history beside theirs.
			if err := r.noLiveUpdaters(ctx); errors.Is(err, errLogGrew) {
				// A new cluster whose first replica appended its genesis and joined the group
				// since this one asked for the log's end: read what landed; the checks above run
				// again at the new end.
				if end, err = r.plog.End(ctx); err != nil {
					return fmt.Errorf("reading the end of the posterior log %s: %w", r.plog.Topic(), err)
				}
			} else if err != nil {
				return err
			} else if err := r.appendGenesis(ctx); err != nil {
				return err
			} else {
				awaited = true
			}
		}
		rec, err := rd.Next(ctx)
		if err != nil {
			return fmt.Errorf("reading the posterior log %s for its genesis: %w", r.plog.Topic(), err)
		}
		next = rec.Offset + 1
		e, reason, err := chain.Offer(rec)
		if err != nil {
			return err
		}
		if reason == postlog.Unauthenticated {
			r.unauthenticated(rec)
			if rec.Offset < end {
				forged++
				unknown.Add(postlog.Authenticate(r.keys, rec))
			}
			continue
		}
		if rec.Offset < end {
			authentic++
		}
		if reason != postlog.Accepted {
			r.ignored(rec, e, reason)
			continue
		}
		if err := r.checkSettings(e, rec.Offset); err != nil {
			return err
		}
		m, err := e.Body.Model(e.PosteriorSHA256)
		if err != nil {
			return fmt.Errorf("the posterior log's genesis (offset %d): %w", rec.Offset, err)
		}
		hb, err := postlog.MarshalHead(chain.Head())
		if err != nil {
			return err
		}
		origin := fmt.Sprintf("posterior log %s genesis %s", r.plog.Topic(), e.PosteriorSHA256)
		if err := r.ledger.Checkpoint(&ledger.Checkpoint{Model: m, Origin: origin, LogHead: hb}); err != nil {
			return err
		}
		r.chain, r.read = chain, rec.Offset+1
		r.host.SetCurrent(m)
		r.remember(m)
		r.lg.Info("posterior log genesis applied", "entry_writer", e.Writer, "posterior_version", m.Version, "posterior_sha256", e.PosteriorSHA256)
		return nil
	}
}
