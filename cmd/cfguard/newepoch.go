package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/cli"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/replica"
	"github.com/cfguard/cfguard/stream"
)

// epochReport is what `cfguard new-epoch` prints.
type epochReport struct {
	Epoch     uint64        `json:"epoch"`
	Seq       uint64        `json:"seq"`
	Offset    int64         `json:"offset"` // the new genesis's offset in the log
	MovedPast *postlog.Past `json:"moved_past"`
	// Stopped says why the replicas stopped at MovedPast ("" when forced on a log that follows).
	Stopped         string        `json:"stopped"`
	PosteriorSHA256 string        `json:"posterior_sha256"`
	Version         uint64        `json:"posterior_version"`
	Covers          map[int]int64 `json:"covers"`
	Settings        string        `json:"settings"` // whose: "the log's genesis at offset N", or "file"
}

// logState is the posterior log played through the acceptance rule to an end offset, as every
// replica plays it.
type logState struct {
	chain             *postlog.Chain
	model             *bnn.Model // the head's posterior, checked by hash
	genesis           *postlog.Entry
	genesisOffset     int64
	stopped           error // why the chain stopped at chain.Stuck()
	authentic, forged int
}

// playLog plays the log's records below end.
func playLog(ctx context.Context, plog *postlog.Log, keys *clusterkey.Keyring, end int64) (*logState, error) {
	rd, err := plog.Read(0)
	if err != nil {
		return nil, err
	}
	defer rd.Close()
	st := &logState{chain: postlog.NewChain(keys)}
	for next := int64(0); next < end; {
		rec, err := rd.Next(ctx)
		if err != nil {
			return nil, fmt.Errorf("reading %s at offset %d of %d: %w", plog.Topic(), next, end, err)
		}
		next = rec.Offset + 1
		fork := st.chain.Fork()
		e, reason, err := fork.Offer(rec)
		switch {
		case errors.Is(err, postlog.ErrUnknownFormat):
			st.chain, st.stopped = fork, err
			st.authentic++
			continue
		case err != nil:
			return nil, err
		case reason == postlog.Unauthenticated:
			st.forged++
			continue
		}
		st.authentic++
		if reason != postlog.Accepted {
			continue
		}
		m := st.model
		switch {
		case e.Kind == postlog.Genesis && e.Epoch > 0:
			// The head's posterior goes on (the rule checked its hash).
		case e.Kind == postlog.Genesis:
			m, err = e.Body.Model(e.PosteriorSHA256)
		default:
			m, err = e.Apply(m)
		}
		if err != nil {
			// Every replica stops here too (a posterior that does not hash to its entry).
			st.chain.Block(rec)
			st.stopped = fmt.Errorf("entry %d: %w", e.Seq, err)
			continue
		}
		st.chain, st.model = fork, m
		if e.Kind == postlog.Genesis {
			st.genesis, st.genesisOffset, st.stopped = e, rec.Offset, nil
		}
	}
	return st, nil
}

// cmdNewEpoch moves a replicated deployment's posterior log past a record its replicas cannot
// apply: it plays the log as the replicas do to where they stopped, and appends a new genesis
// (the next epoch) authenticated with the cluster key, that names that record (offset and
// SHA-256) and carries the head's posterior, whole and checked by hash, its coverage and the
// cluster's settings. The replicas accept it as the head's successor and resume from it: the
// next updater claims a term and applies the input records after the head's coverage, those
// the unreadable entry covered included, so none is skipped or applied twice. On a log that
// follows (no record stops it) it refuses unless --force, which moves past the head itself.
func cmdNewEpoch(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("new-epoch", flag.ContinueOnError)
	path := fs.String("config", "config.yaml", "a replica's configuration (kafka.*, replication.posterior_topic, replication.key_file)")
	force := fs.Bool("force", false, "write a new epoch on a log that does not stop the replicas (after its head)")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	cfg, err := config.LoadFile(*path)
	if err != nil {
		return err
	}
	if cfg.Embedded() || !cfg.Replication.Enabled {
		return fmt.Errorf("%w: %s is not a replica's configuration (replication.enabled and kafka.brokers): new-epoch writes a replicated deployment's posterior log",
			cli.ErrUsage, *path)
	}
	keys, err := clusterkey.Load(cfg.Replication.KeyFile)
	if err != nil {
		return fmt.Errorf("%w: a new epoch must be authenticated with the cluster key, or no replica accepts it", err)
	}
	tlsCfg, err := stream.LoadTLS(stream.TLSFiles(cfg.Kafka.TLS))
	if err != nil {
		return err
	}
	conn := stream.ConnConfig{Brokers: cfg.Kafka.Brokers, TLS: tlsCfg, ClientID: cfg.Kafka.ClientID}
	if cfg.Kafka.SASL.Mechanism != "" {
		conn.SASL = &stream.SASL{Mechanism: cfg.Kafka.SASL.Mechanism, User: cfg.Kafka.SASL.Username, Password: cfg.Kafka.SASL.Password}
	}
	log := newLogger(stderr, cfg.Log)
	plog, err := postlog.OpenExistingWriter(ctx, conn, cfg.Replication.PosteriorTopic, keys, log)
	if err != nil {
		return err
	}
	defer plog.Close()
	end, err := plog.End(ctx)
	if err != nil {
		return err
	}
	st, err := playLog(ctx, plog, keys, end)
	if err != nil {
		return err
	}
	head := st.chain.Head()
	switch {
	case st.authentic == 0 && st.forged > 0:
		return fmt.Errorf("none of the %d records of %s authenticates under the keys of replication.key_file %s (%s): this is not the cluster's key file; "+
			"nothing was written", st.forged, plog.Topic(), keys.Source(), strings.Join(keys.IDs(), ", "))
	case head == nil:
		return fmt.Errorf("%s holds no genesis: there is nothing to move past (start the replicas: the first writes the genesis); nothing was written", plog.Topic())
	case st.chain.Stuck() == nil && !*force:
		return fmt.Errorf("the replicas are not stopped: %s follows to its head, entry %d at offset %d (posterior %s); a new epoch is for a log "+
			"with a record the replicas cannot apply. --force writes one after the head anyway; nothing was written",
			plog.Topic(), head.Seq, head.Offset, head.PosteriorSHA256)
	}
	past := st.chain.Stuck()
	if past == nil {
		past = &postlog.Past{Offset: head.Offset, SHA256: head.Hash}
	}
	body, err := postlog.NewBody(st.model)
	if err != nil {
		return err
	}
	rep := epochReport{Epoch: head.Epoch + 1, Seq: head.Seq + 1, MovedPast: past, PosteriorSHA256: head.PosteriorSHA256,
		Version: head.Version, Covers: head.Covers}
	if st.stopped != nil {
		rep.Stopped = st.stopped.Error()
	}
	// The cluster's settings go on; a log begun without them records the file's from now on.
	settings := st.genesis.Settings
	rep.Settings = fmt.Sprintf("the log's genesis at offset %d", st.genesisOffset)
	if len(settings) == 0 {
		if settings, err = replica.ClusterSettings(cfg); err != nil {
			return err
		}
		rep.Settings = "file"
	}
	nonce := make([]byte, 4)
	if _, err := rand.Read(nonce); err != nil {
		return err
	}
	host, _ := os.Hostname()
	e := &postlog.Entry{Format: postlog.Format, Kind: postlog.Genesis, Seq: rep.Seq, Parent: head.Hash, Term: head.Term,
		Writer: "new-epoch@" + host + "/" + hex.EncodeToString(nonce), Version: head.Version, ParentVersion: head.Version,
		InputTopic: cfg.Kafka.Topic, Covers: head.Covers, PosteriorSHA256: head.PosteriorSHA256, Body: body, Settings: settings,
		Epoch: rep.Epoch, Past: past}
	v, err := e.Encode()
	if err != nil {
		return err
	}
	if err := plog.Append(ctx, fmt.Sprintf("epoch/%d", e.Epoch), v); err != nil {
		return err
	}
	// Read it back as the replicas will: accepted, or another record came first.
	newEnd, err := plog.End(ctx)
	if err != nil {
		return err
	}
	after, err := playLog(ctx, plog, keys, newEnd)
	if err != nil {
		return err
	}
	want := postlog.Hash(v)
	h := after.chain.Head()
	if h.Epoch != e.Epoch || h.GenesisHash != hex.EncodeToString(want[:]) {
		return fmt.Errorf("the new epoch was written but not accepted: another record reached %s first (its head is entry %d at offset %d, epoch %d); "+
			"run new-epoch again", plog.Topic(), h.Seq, h.Offset, h.Epoch)
	}
	rep.Offset = h.GenesisOffset
	log.Info("new epoch accepted: the replicas resume from it", "epoch", e.Epoch, "offset", rep.Offset, "moved_past", past.Offset,
		"posterior_sha256", e.PosteriorSHA256, "covers", e.Covers)
	return printJSON(stdout, rep)
}
