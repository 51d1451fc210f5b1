package command

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/cli"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/replica"
	"github.com/cfguard/cfguard/stream"
)

// EpochReport is what `cfguard new-epoch` prints.
type EpochReport struct {
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
	model             *bnn.Model        // the head's posterior, checked by hash
	hash              bnn.WeightsHasher // hashes the posteriors the play applies
	genesis           *postlog.Entry
	genesisOffset     int64
	stopped           error // why the chain stopped at chain.Stuck()
	authentic, forged int
	// unknown counts the records signed under key ids not in the key file.
	unknown clusterkey.UnknownKeys
}

// inputEnds are the input topic's end offsets as last asked. They only grow, so they are asked
// again only when an increment covers more than they did, as a replica asks them
// (replica.checkCoverage).
type inputEnds struct {
	plog  *postlog.Log
	topic string
	ends  map[int]int64
}

// check returns nil when covers is within the input's ends, an error wrapping postlog.ErrPastEnd
// when it passes them as the broker gives them now, or the broker's error.
func (in *inputEnds) check(ctx context.Context, covers map[int]int64) error {
	if postlog.CheckCoverage(covers, in.ends) == nil {
		return nil
	}
	ends, err := in.plog.InputEnds(ctx, in.topic)
	if err != nil {
		return err
	}
	in.ends = ends
	return postlog.CheckCoverage(covers, ends)
}

// playLog plays the log's records below end, checking increments' coverage against inputTopic's
// ends as a replica does.
func playLog(ctx context.Context, plog *postlog.Log, keys *clusterkey.Keyring, end int64, inputTopic string) (*logState, error) {
	rd, err := plog.Read(0)
	if err != nil {
		return nil, err
	}
	defer rd.Close()
	st := &logState{chain: postlog.NewChain(keys)}
	ends := &inputEnds{plog: plog, topic: inputTopic}
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
			st.unknown.Add(postlog.Authenticate(keys, rec))
			continue
		}
		st.authentic++
		if reason == postlog.Accepted && e.Kind == postlog.Increment {
			switch err := ends.check(ctx, e.Covers); {
			case errors.Is(err, postlog.ErrPastEnd):
				reason = postlog.PastEnd // every replica refuses it
			case err != nil:
				return nil, err
			}
		}
		if reason != postlog.Accepted {
			if err := st.chain.Diverged(rec, e); err != nil {
				st.stopped = err // every replica that refused the entry this one follows stops here
			}
			continue
		}
		m := st.model
		switch {
		case e.Kind == postlog.Genesis && e.Epoch > 0 && m != nil:
			// The head's posterior goes on (the rule checked its hash); a later epoch that
			// begins a log whose start is gone brings its posterior (below).
		case e.Kind == postlog.Genesis:
			m, err = e.Body.Model(e.PosteriorSHA256)
		default:
			m, err = e.ApplyHashing(m, &st.hash)
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
	headFrom := fs.String("head-from", "", "a replica's API URL: write the new epoch after the head that replica applied, "+
		"for a log that no longer holds it (the topic recreated); it uses http.token of --config")
	wait := fs.Duration("wait", 60*time.Second, "with --head-from: how long to wait for that replica to resume from the new epoch")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	if *wait <= 0 {
		return fmt.Errorf("%w: --wait %v, want a positive duration (the time the replica at --head-from has to resume)", cli.ErrUsage, *wait)
	}
	waitSet := false
	fs.Visit(func(f *flag.Flag) { waitSet = waitSet || f.Name == "wait" })
	if waitSet && *headFrom == "" {
		return fmt.Errorf("%w: --wait is the wait for the replica at --head-from: give --head-from too, or drop --wait", cli.ErrUsage)
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
	st, err := playLog(ctx, plog, keys, end, cfg.Kafka.Topic)
	if err != nil {
		return err
	}
	head := st.chain.Head()
	// The replica's API is asked as its peers ask it (replication.peer_tls).
	tr, err := replica.PeerTransport(cfg.Replication)
	if err != nil {
		return err
	}
	client := &http.Client{Transport: tr}
	if *headFrom != "" {
		rh, err := fetchHead(ctx, client, *headFrom, cfg.HTTP.Token)
		if err != nil {
			return err
		}
		if head != nil && head.Seq >= rh.head.Seq {
			return fmt.Errorf("%s holds entry %d at offset %d, as far as the head of the replica at %s (entry %d): the log did not lose it; "+
				"run new-epoch without --head-from; nothing was written", plog.Topic(), head.Seq, head.Offset, *headFrom, rh.head.Seq)
		}
		head, st.model = rh.head, rh.model
		st.chain = postlog.Resume(head, keys)
		st.stopped = fmt.Errorf("the log no longer holds entry %d (offset %d), which the replica at %s applied last", head.Seq, head.Offset, *headFrom)
		*force = true
	}
	switch {
	case st.authentic == 0 && st.forged > 0:
		return fmt.Errorf("none of the %d records of %s authenticates under the keys of replication.key_file %s (%s): this is not the cluster's key file; "+
			"nothing was written", st.forged, plog.Topic(), keys.Source(), strings.Join(keys.IDs(), ", "))
	case head == nil && st.unknown.Records > 0:
		return fmt.Errorf("%s holds no genesis under the keys of replication.key_file %s (%s), and %d records signed under key ids it does not "+
			"hold (%s): if those are the cluster's (a key rotated out of the file while the log holds entries signed with it), run new-epoch "+
			"with the cluster's key file, holding every key the log was signed with; nothing was written",
			plog.Topic(), keys.Source(), strings.Join(keys.IDs(), ", "), st.unknown.Records, &st.unknown)
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
	rep := EpochReport{Epoch: head.Epoch + 1, Seq: head.Seq + 1, MovedPast: past, PosteriorSHA256: head.PosteriorSHA256,
		Version: head.Version, Covers: head.Covers}
	if st.stopped != nil {
		rep.Stopped = st.stopped.Error()
	}
	// The cluster's settings go on; a log begun without them, or that lost its genesis, records
	// the file's from now on (the replicas check them against theirs).
	var settings map[string]string
	if st.genesis != nil {
		settings = st.genesis.Settings
		rep.Settings = fmt.Sprintf("the log's genesis at offset %d", st.genesisOffset)
	}
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
	after, err := playLog(ctx, plog, keys, newEnd, cfg.Kafka.Topic)
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
	if *headFrom != "" {
		// Read back by the replica itself: a key file that is not the cluster's would write an
		// epoch that this command accepts and every replica ignores.
		if err := awaitEntry(ctx, client, *headFrom, cfg.HTTP.Token, e.Seq, *wait); err != nil {
			return fmt.Errorf("the new epoch was written at offset %d, but %w: check that replication.key_file of %s is the cluster's", rep.Offset, err, *path)
		}
	}
	log.Info("new epoch accepted: the replicas resume from it", "epoch", e.Epoch, "offset", rep.Offset, "moved_past", past.Offset,
		"posterior_sha256", e.PosteriorSHA256, "covers", e.Covers)
	return printJSON(stdout, rep)
}

// remoteHead is the head a replica applied last and its posterior, as its API reports them.
type remoteHead struct {
	head  *postlog.Head
	model *bnn.Model
}

// fetchHead reads from a replica's API (base URL u, with client and the bearer token) the posterior log's head it
// applied last (GET /v1/model's replication block) and its posterior (GET /v1/model/posterior
// and its sidecar), checked against the head's posterior_sha256 and version.
func fetchHead(ctx context.Context, client *http.Client, u, token string) (*remoteHead, error) {
	get := func(path string) ([]byte, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(u, "/")+path, nil)
		if err != nil {
			return nil, fmt.Errorf("--head-from %s: %w", u, err)
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := client.Do(req)
		if err != nil {
			return nil, fmt.Errorf("--head-from: %w", err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<30))
		if err != nil {
			return nil, fmt.Errorf("--head-from: GET %s: %w", path, err)
		}
		if resp.StatusCode != http.StatusOK {
			return nil, fmt.Errorf("--head-from: GET %s%s: %s %s", u, path, resp.Status, strings.TrimSpace(string(body)))
		}
		return body, nil
	}
	b, err := get("/v1/model")
	if err != nil {
		return nil, err
	}
	var view struct {
		Version     uint64 `json:"posterior_version"`
		Replication *struct {
			Entry   uint64        `json:"entry"`
			Term    uint64        `json:"term"`
			Offset  int64         `json:"offset"`
			Hash    string        `json:"hash"`
			Epoch   uint64        `json:"epoch"`
			SHA     string        `json:"posterior_sha256"`
			Covers  map[int]int64 `json:"covers"`
			Stopped string        `json:"stopped"`
		} `json:"replication"`
	}
	if err := json.Unmarshal(b, &view); err != nil {
		return nil, fmt.Errorf("--head-from: GET %s/v1/model: %w", u, err)
	}
	rp := view.Replication
	if rp == nil || rp.Hash == "" {
		return nil, fmt.Errorf("--head-from %s: GET /v1/model has no replication block with the head's hash: not a replica of this build", u)
	}
	sidecar, err := get("/v1/model/posterior/sidecar")
	if err != nil {
		return nil, err
	}
	weights, err := get("/v1/model/posterior")
	if err != nil {
		return nil, err
	}
	m, err := bnn.Decode(sidecar, weights)
	if err != nil {
		return nil, fmt.Errorf("--head-from %s: the posterior: %w", u, err)
	}
	if sha, err := postlog.PosteriorHash(m); err != nil || sha != rp.SHA || m.Version != view.Version {
		return nil, fmt.Errorf("--head-from %s: the posterior served (version %d, sha256 %s) is not the head's (version %d, sha256 %s): "+
			"the replica moved on while it was read; run new-epoch again", u, m.Version, sha, view.Version, rp.SHA)
	}
	return &remoteHead{model: m, head: &postlog.Head{Seq: rp.Entry, Hash: rp.Hash, Offset: rp.Offset, Term: rp.Term, Version: view.Version,
		Covers: rp.Covers, PosteriorSHA256: rp.SHA, Epoch: rp.Epoch}}, nil
}

// awaitEntry waits, at most wait, until the replica at u reports entry seq or a later one as
// its head, not stopped.
func awaitEntry(ctx context.Context, client *http.Client, u, token string, seq uint64, wait time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	var last string
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(u, "/")+"/v1/model", nil)
		if err != nil {
			return err
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		if resp, err := client.Do(req); err == nil {
			var view struct {
				Replication struct {
					Entry   uint64 `json:"entry"`
					Stopped string `json:"stopped"`
				} `json:"replication"`
			}
			err = json.NewDecoder(resp.Body).Decode(&view)
			resp.Body.Close()
			if err == nil && view.Replication.Entry >= seq && view.Replication.Stopped == "" {
				return nil
			}
			last = fmt.Sprintf("it reports entry %d, stopped: %q", view.Replication.Entry, view.Replication.Stopped)
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the replica at %s did not resume from it within %s (%s)", u, wait, last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}
