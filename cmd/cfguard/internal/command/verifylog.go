package command

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/internal/cli"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/stream"
	"github.com/cfguard/cfguard/update"
)

// VerifyReport is what `cfguard verify-log` prints.
type VerifyReport struct {
	Entries      int             `json:"entries"`        // accepted entries read
	Increments   int             `json:"increments"`     // increments re-executed
	Matched      int             `json:"matched"`        // re-executed to the entry's bits
	Unverifiable []VerifyProblem `json:"unverifiable"`   // input past the topic's retention
	Mismatches   []VerifyProblem `json:"mismatches"`     // re-executed to something else
	Ignored      map[string]int  `json:"ignored"`        // records the acceptance rule refused, by reason
	Head         *postlog.Head   `json:"head,omitempty"` // the last accepted entry

	// Unauthenticated are the records whose authenticator does not verify under the cluster
	// key: every replica ignored them too (also counted in Ignored).
	Unauthenticated []VerifyProblem `json:"unauthenticated"`
	// Stopped are the authenticated records the replicas could not apply (an unknown format, or
	// a posterior that does not hash to its entry), each followed by the new epoch that moved
	// past it, if one did.
	Stopped []VerifyProblem `json:"stopped"`
	// Settings says whose update.*, certify.* and kafka.* settings re-executed the increments.
	Settings verifySettings `json:"settings"`
}

// verifySettings: the log's (its genesis records them) or the file's (a genesis written
// without them).
type verifySettings struct {
	From string `json:"from"` // "genesis at offset N", or "file"
	// DifferFromFile are the cluster-wide keys whose value in the log differs from --config's:
	// the log's were used.
	DifferFromFile []string `json:"differ_from_file"`
}

// ignoredPosterior counts, in VerifyReport.Ignored, the accepted entries whose posterior cannot
// be made (it does not hash to the entry, or its body does not decode): listed in Stopped.
const ignoredPosterior = "posterior_mismatch"

type VerifyProblem struct {
	Seq    uint64 `json:"seq"`
	Offset int64  `json:"offset"`
	Why    string `json:"why"`
}

// cmdVerifyLog plays the posterior log of a replicated deployment and re-executes its
// increments from the input records they cover: for each, the records of kafka.topic in the
// covered ranges, decoded with the model's schema and kafka.max_record_bytes, sorted by
// (partition, offset), through update.LastLayer with the entry's seed and the configuration's
// update.*, certify.* and kafka.* settings the log's genesis records (the --config file's when
// it records none). It reports every increment whose records, KL or posterior hash
// differ from the entry's. Re-execution is bit-identical only on the build, GOARCH and engine that
// wrote the entry. Records that do not
// authenticate under replication.key_file are listed, and ignored as every replica ignores them. An
// increment that covers offsets past the input topic's end is a mismatch (and ignored, as every
// replica refuses it), not input past retention.
func cmdVerifyLog(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("verify-log", flag.ContinueOnError)
	path := fs.String("config", "config.yaml", "a replica's configuration (kafka.*, replication.posterior_topic, update.*, certify.*)")
	from := fs.Uint64("from", 0, "first entry to re-execute (earlier ones are applied as recorded)")
	to := fs.Uint64("to", ^uint64(0), "last entry to re-execute")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	if *from > *to {
		// Nothing would be re-executed, and the report would read as a log that verified.
		return fmt.Errorf("%w: --from %d is past --to %d: no entry would be re-executed", cli.ErrUsage, *from, *to)
	}
	cfg, err := config.LoadFile(*path)
	if err != nil {
		return err
	}
	if cfg.Embedded() || !cfg.Replication.Enabled {
		return fmt.Errorf("%w: %s is not a replica's configuration (replication.enabled and kafka.brokers): verify-log reads a replicated deployment's posterior log",
			cli.ErrUsage, *path)
	}
	tlsCfg, err := stream.LoadTLS(stream.TLSFiles(cfg.Kafka.TLS))
	if err != nil {
		return err
	}
	conn := stream.ConnConfig{Brokers: cfg.Kafka.Brokers, TLS: tlsCfg, ClientID: cfg.Kafka.ClientID}
	if cfg.Kafka.SASL.Mechanism != "" {
		conn.SASL = &stream.SASL{Mechanism: cfg.Kafka.SASL.Mechanism, User: cfg.Kafka.SASL.Username, Password: cfg.Kafka.SASL.Password}
	}
	keys, err := clusterkey.Load(cfg.Replication.KeyFile)
	if err != nil {
		return err
	}
	log := newLogger(stderr, cfg.Log)
	plog, err := postlog.OpenExisting(ctx, conn, cfg.Replication.PosteriorTopic, log)
	if err != nil {
		return err
	}
	defer plog.Close()
	end, err := plog.End(ctx)
	if err != nil {
		return err
	}
	rd, err := plog.Read(0)
	if err != nil {
		return err
	}
	defer rd.Close()
	ends := &inputEnds{plog: plog, topic: cfg.Kafka.Topic}
	v := &verifier{cfg: cfg, conn: conn, budget: certify.KLBudget(cfg.Certify.Delta)}
	defer v.close()
	rep := VerifyReport{Ignored: map[string]int{}, Unauthenticated: []VerifyProblem{}, Stopped: []VerifyProblem{}, Settings: verifySettings{From: "file", DifferFromFile: []string{}}}
	chain := postlog.NewChain(keys)
	var (
		m    *bnn.Model
		hash bnn.WeightsHasher // hashes the posteriors the play applies, the unchanged layers once
	)
	progress := time.Now()
	authenticIgnored := 0              // records that authenticate and that the chain did not accept
	var unknown clusterkey.UnknownKeys // records signed under key ids not in the key file
	for next := int64(0); next < end; {
		rec, err := rd.Next(ctx)
		if err != nil {
			return fmt.Errorf("reading %s at offset %d of %d: %w", plog.Topic(), next, end, err)
		}
		next = rec.Offset + 1
		parent := chain.Head()
		var before *postlog.Head
		if parent != nil {
			h := *parent
			before = &h
		}
		fork := chain.Fork()
		e, reason, err := fork.Offer(rec)
		if errors.Is(err, postlog.ErrUnknownFormat) {
			// The replicas stop here until a new epoch moves past it (cfguard new-epoch).
			chain = fork
			rep.Stopped = append(rep.Stopped, VerifyProblem{Offset: rec.Offset, Why: err.Error()})
			rep.Ignored[string(postlog.UnknownFormat)]++
			continue
		}
		if err != nil {
			return err
		}
		if reason == postlog.Accepted && e.Kind == postlog.Increment {
			// The input may have grown since the last entry: check asks again before calling it a
			// mismatch.
			switch err := ends.check(ctx, e.Covers); {
			case errors.Is(err, postlog.ErrPastEnd):
				// Every replica refuses it too: it never becomes the head.
				rep.Mismatches = append(rep.Mismatches, VerifyProblem{Seq: e.Seq, Offset: rec.Offset, Why: err.Error()})
				reason = postlog.PastEnd
			case err != nil:
				return err
			}
		}
		var next *bnn.Model // the posterior after e, an accepted genesis or increment
		if reason == postlog.Accepted && e.Kind != postlog.Claim {
			switch {
			case e.Kind == postlog.Genesis && e.Epoch > 0 && m != nil:
				next = m // a new epoch goes on with the head's posterior (the rule checked its hash)
			case e.Kind == postlog.Genesis:
				next, err = e.Body.Model(e.PosteriorSHA256)
			default:
				next, err = e.ApplyHashing(m, &hash)
			}
			if err != nil {
				// Every replica stops here too, until a new epoch moves past it: the entry never
				// becomes the head.
				chain.Block(rec)
				rep.Stopped = append(rep.Stopped, VerifyProblem{Seq: e.Seq, Offset: rec.Offset, Why: fmt.Sprintf("entry %d: %v", e.Seq, err)})
				rep.Ignored[ignoredPosterior]++
				continue
			}
		}
		if reason == postlog.Accepted {
			chain = fork
		}
		if reason == postlog.Unauthenticated {
			err := postlog.Authenticate(keys, rec)
			rep.Unauthenticated = append(rep.Unauthenticated, VerifyProblem{Offset: rec.Offset, Why: err.Error()})
			unknown.Add(err)
		} else if reason != postlog.Accepted {
			authenticIgnored++
		}
		if reason != postlog.Accepted {
			rep.Ignored[string(reason)]++
			if err := chain.Diverged(rec, e); err != nil {
				// The replicas that refused the entry this one follows stop here until a new
				// epoch moves past it.
				rep.Stopped = append(rep.Stopped, VerifyProblem{Offset: rec.Offset, Why: err.Error()})
			}
			continue
		}
		rep.Entries++
		switch e.Kind {
		case postlog.Genesis:
			m = next
			if err := v.useSettings(cfg, e, rec.Offset, &rep.Settings, log); err != nil {
				return err
			}
			continue
		case postlog.Claim:
			continue
		}
		if e.Seq >= *from && e.Seq <= *to {
			rep.Increments++
			switch why, err := v.check(ctx, m, before, e); {
			case errors.Is(err, errUnverifiable):
				rep.Unverifiable = append(rep.Unverifiable, VerifyProblem{Seq: e.Seq, Offset: rec.Offset, Why: err.Error()})
			case err != nil:
				return fmt.Errorf("entry %d: %w", e.Seq, err)
			case why != "":
				rep.Mismatches = append(rep.Mismatches, VerifyProblem{Seq: e.Seq, Offset: rec.Offset, Why: why})
			default:
				rep.Matched++
			}
		}
		m = next
		if time.Since(progress) > 5*time.Second {
			log.Info("verifying the posterior log", "offset", rec.Offset, "end", end, "matched", rep.Matched, "mismatches", len(rep.Mismatches))
			progress = time.Now()
		}
	}
	rep.Head = chain.Head()
	if err := printJSON(stdout, rep); err != nil {
		return err
	}
	if rep.Entries == 0 && len(rep.Unauthenticated) > 0 && authenticIgnored > 0 {
		// Records under the file's keys but no genesis: the file lacks the key the log began under.
		return fmt.Errorf("no genesis of %s authenticates under the keys of replication.key_file %s (%s): %d of its records do (none accepted "+
			"without a genesis), %d do not (key ids it does not hold: %s): give verify-log the cluster's key file, with every key the log "+
			"was signed with", plog.Topic(), keys.Source(), strings.Join(keys.IDs(), ", "), authenticIgnored, len(rep.Unauthenticated),
			&unknown)
	}
	if rep.Entries == 0 && len(rep.Unauthenticated) > 0 {
		return fmt.Errorf("none of the %d records of %s authenticates under the keys of replication.key_file %s: give verify-log the cluster's key file",
			len(rep.Unauthenticated), plog.Topic(), keys.Source())
	}
	if p := chain.Stuck(); p != nil {
		return fmt.Errorf("the replicas are stopped at offset %d of %s, a record they cannot apply: upgrade cfguard, or move the log past it with "+
			"cfguard new-epoch (docs/RUNBOOK.md)", p.Offset, plog.Topic())
	}
	if len(rep.Mismatches) > 0 {
		return fmt.Errorf("%d increments do not match the input records they cover (%d re-executed)", len(rep.Mismatches), rep.Increments)
	}
	if rep.Head != nil && *from > rep.Head.Seq {
		// Nothing was re-executed, and the report would read as a log that verified.
		return fmt.Errorf("--from %d is past the log's head, entry %d: no entry was re-executed", *from, rep.Head.Seq)
	}
	return nil
}

// useSettings makes the verifier re-execute with the settings the genesis e (at offset)
// records, which decided the increments, whatever the file's are; a genesis written without
// settings leaves the file's, with a warning.
func (v *verifier) useSettings(file *config.Config, e *postlog.Entry, offset int64, rs *verifySettings, log *slog.Logger) error {
	if len(e.Settings) == 0 {
		log.Warn("the posterior log's genesis records no settings: re-executing with the file's update.*, certify.* and kafka.* (they must be the updater's)",
			"genesis_offset", offset)
		return nil
	}
	cfg, changed, err := file.WithSettings(e.Settings)
	if err != nil {
		return fmt.Errorf("the settings of the posterior log's genesis (offset %d): %w", offset, err)
	}
	v.cfg, v.budget = cfg, certify.KLBudget(cfg.Certify.Delta)
	rs.From, rs.DifferFromFile = fmt.Sprintf("genesis at offset %d", offset), changed
	log.Info("re-executing with the settings the posterior log's genesis records", "genesis_offset", offset, "differ_from_file", changed)
	return nil
}

// errUnverifiable: an increment's input records are no longer in kafka.topic.
var errUnverifiable = errors.New("input past the topic's retention")

// verifier re-executes increments.
type verifier struct {
	cfg     *config.Config
	conn    stream.ConnConfig
	budget  float64
	readers map[int]*partReader
}

// check re-executes e on prev (the posterior of its parent, whose head is parent) and returns
// why it differs from e ("" when it matches).
func (v *verifier) check(ctx context.Context, prev *bnn.Model, parent *postlog.Head, e *postlog.Entry) (string, error) {
	X, y, dead, err := v.inputs(ctx, prev, postlog.Covered(parent, e))
	if err != nil {
		return "", err
	}
	counts := e.Counts
	if counts == nil {
		counts = &postlog.Counts{}
	}
	if int64(dead) != counts.DeadLettered {
		return fmt.Sprintf("%d records fail the schema, the entry dead-lettered %d", dead, counts.DeadLettered), nil
	}
	good := int64(len(X))
	if want := counts.Applied + counts.Held + counts.Failed; good != want {
		return fmt.Sprintf("%d good records, the entry covers %d (applied %d, held %d, failed %d)", good, want, counts.Applied, counts.Held, counts.Failed), nil
	}
	if good == 0 {
		if e.Version != prev.Version {
			return "no records, yet the version moves", nil
		}
		return checkEvents(e), nil
	}
	from, ucfg := v.cfg.Update.Step(prev, len(X), e.Seed)
	next, st, err := update.LastLayer(ctx, from, X, y, ucfg)
	if err != nil {
		if e.Outcome == postlog.Failed {
			return checkEvents(e, "update_failed"), nil
		}
		return fmt.Sprintf("the update fails (%v), the entry says %s", err, e.Outcome), nil
	}
	outcome, over := certify.Decide(st.KL, v.budget, v.cfg.Certify.OnBreach)
	if string(outcome) != e.Outcome {
		return fmt.Sprintf("outcome %s at KL %v, the entry says %s at KL %v", outcome, st.KL, e.Outcome, e.KL), nil
	}
	var events []string
	if over {
		events = append(events, "kl_over_budget")
	}
	if outcome == certify.OutcomeRejected {
		events = append(events, "increment_held")
	}
	if why := checkEvents(e, events...); why != "" {
		return why, nil
	}
	kl := st.KL
	if outcome == certify.OutcomeClipped {
		if next, _, err = update.ClipToBudget(prev, next, v.budget); err != nil {
			return fmt.Sprintf("clipping fails: %v", err), nil
		}
		if kl, _, err = certify.KL(next, prev); err != nil {
			return "", err
		}
	}
	if kl != e.KL {
		return fmt.Sprintf("KL %v, the entry records %v", kl, e.KL), nil
	}
	if outcome == certify.OutcomeRejected {
		return "", nil
	}
	sha, err := postlog.PosteriorHash(next)
	if err != nil {
		return "", err
	}
	if sha != e.PosteriorSHA256 {
		return fmt.Sprintf("posterior %s, the entry records %s", sha, e.PosteriorSHA256), nil
	}
	return "", nil
}

// checkEvents returns why the posterior events increment e carries are not those of its
// re-executed step, the event types want in order, each naming e ("" when they are). An entry
// that says nothing of events (no events, no events_through: written by a build that did not
// record them) is not checked.
func checkEvents(e *postlog.Entry, want ...string) string {
	if len(e.Events) == 0 && e.EventsThrough == 0 {
		return ""
	}
	var got []string
	for _, ev := range e.Events {
		var v struct {
			Type     string `json:"type"`
			LogEntry uint64 `json:"log_entry"`
		}
		if err := json.Unmarshal(ev.Value, &v); err != nil {
			return fmt.Sprintf("an event of the entry is not JSON: %v", err)
		}
		if v.LogEntry != e.Seq {
			return fmt.Sprintf("its %s event names entry %d", v.Type, v.LogEntry)
		}
		got = append(got, v.Type)
	}
	if !slices.Equal(got, want) {
		return fmt.Sprintf("events %v, the step has %v", got, want)
	}
	return ""
}

// inputs reads the covered ranges of kafka.topic and decodes them with prev's schema, in
// (partition, offset) order: the good records' features and labels, and how many fail. Each
// partition is read by one reader that moves on from range to range (the ranges of successive
// increments are contiguous).
func (v *verifier) inputs(ctx context.Context, prev *bnn.Model, ranges map[int]postlog.Range) (X [][]float64, y []int, dead int, err error) {
	schema, err := daemon.Schema(prev, v.cfg.Kafka.MaxRecordBytes)
	if err != nil {
		return nil, nil, 0, err
	}
	for _, p := range slices.Sorted(maps.Keys(ranges)) {
		r := ranges[p]
		rd, err := v.reader(p, r.From)
		if err != nil {
			return nil, nil, 0, err
		}
		for off := r.From; off < r.To; {
			rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			msg, err := rd.r.FetchMessage(rctx)
			cancel()
			if err != nil {
				return nil, nil, 0, fmt.Errorf("%w: partition %d [%d, %d) of %s at %d: %v", errUnverifiable, p, r.From, r.To, v.cfg.Kafka.Topic, off, err)
			}
			if msg.Offset != off {
				return nil, nil, 0, fmt.Errorf("%w: partition %d of %s goes on at %d, the entry covers from %d", errUnverifiable, p, v.cfg.Kafka.Topic, msg.Offset, off)
			}
			off, rd.next = msg.Offset+1, msg.Offset+1
			rec, err := schema.Decode(msg.Value)
			if err != nil {
				dead++
				continue
			}
			X, y = append(X, rec.X), append(y, rec.Label)
		}
	}
	return X, y, dead, nil
}

// partReader reads one partition of kafka.topic; next is the offset it reads next.
type partReader struct {
	r    *kafka.Reader
	next int64
}

// reader returns partition p's reader, positioned at from.
func (v *verifier) reader(p int, from int64) (*partReader, error) {
	if v.readers == nil {
		v.readers = map[int]*partReader{}
	}
	rd := v.readers[p]
	if rd == nil {
		dialer, err := v.conn.Dialer()
		if err != nil {
			return nil, err
		}
		rd = &partReader{r: kafka.NewReader(kafka.ReaderConfig{Brokers: v.conn.Brokers, Topic: v.cfg.Kafka.Topic, Partition: p, Dialer: dialer,
			MaxBytes: 16 << 20, MaxWait: postlog.ReaderMaxWait}), next: -1}
		v.readers[p] = rd
	}
	if rd.next != from {
		if err := rd.r.SetOffset(from); err != nil {
			return nil, err
		}
		rd.next = from
	}
	return rd, nil
}

// close closes the readers, all at once: a reader's Close waits for its fetch to end, up to
// postlog.ReaderMaxWait when the broker does not answer, and one partition's wait need not
// follow another's.
func (v *verifier) close() {
	var wg sync.WaitGroup
	for _, rd := range v.readers {
		wg.Go(func() { rd.r.Close() })
	}
	wg.Wait()
}
