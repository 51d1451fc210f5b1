package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/ledger"
)

// share is a replica's part in the CEs (package ceshare, docs/DESIGN.md): registrations and
// deletions accepted by any replica are requests on the CE topic, keyed by CE id; the replica
// that the group <kafka.group_id>.ce gives a partition keeps that partition's CEs in its
// ledger, re-certifies them at every entry of the posterior log, confirms, renews and audits
// them, and publishes their status changes. Reads of a CE another replica owns are forwarded
// to it.
type share struct {
	d          *Daemon
	id         string // replication.replica_id (or the host name)
	partitions int
	prod       *ceshare.Producer
	member     *ceshare.Member
	dir        *ceshare.Directory
	client     *http.Client
	lg         *slog.Logger
	stopping   context.Context // run's: ended once the replica stops
}

// awaitOwner bounds how long a registration waits for its owner to store the CE before it is
// answered 202 (accepted, not yet stored).
const awaitOwner = 10 * time.Second

// advertiseURL is replication.advertise_url, or the API's bound address when http.listen names
// a host, or http://<host name>:<port> when it listens on every interface.
func advertiseURL(configured string, bound net.Addr) (string, error) {
	if configured != "" {
		return configured, nil
	}
	host, port, err := net.SplitHostPort(bound.String())
	if err != nil {
		return "", err
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		if host, err = os.Hostname(); err != nil {
			return "", fmt.Errorf("replication.advertise_url is empty, http.listen listens on every interface and the host name cannot be read (%w): set replication.advertise_url", err)
		}
	}
	return "http://" + net.JoinHostPort(host, port), nil
}

// newShare joins the CE topic: a producer for requests, a member of the CE group (run by
// share.run) and a directory of owners.
func newShare(ctx context.Context, d *Daemon, replicaID string) (*share, error) {
	rc := d.cfg.Replication
	adv, err := advertiseURL(rc.AdvertiseURL, d.httpAddr)
	if err != nil {
		return nil, err
	}
	s := &share{d: d, id: replicaID, partitions: rc.CEPartitions, client: &http.Client{Timeout: 10 * time.Second},
		lg: d.log.With("component", "ceshare")}
	group := d.cfg.Kafka.GroupID + ".ce"
	held, err := d.ledger.ShareOffsets()
	if err != nil {
		return nil, err
	}
	if s.member, err = ceshare.NewMember(ctx, ceshare.MemberConfig{Conn: d.conn, Topic: rc.CETopic, Group: group, Partitions: rc.CEPartitions,
		ReplicaID: replicaID, AdvertiseURL: adv, Held: slices.Sorted(maps.Keys(held)), SessionTimeout: rc.SessionTimeout,
		HeartbeatInterval: rc.HeartbeatInterval, Keys: d.rep.keys,
		OnUnauthenticated: func(int, int64) { d.rep.m.Unauthenticated.WithLabelValues(rc.CETopic).Inc() }}, s, s.lg); err != nil {
		return nil, err
	}
	if s.prod, err = ceshare.NewProducer(ctx, d.conn, rc.CETopic, d.rep.keys, s.lg); err != nil {
		return nil, err
	}
	if s.dir, err = ceshare.NewDirectory(ctx, d.conn, group, rc.CETopic, rc.CEPartitions, s.lg); err != nil {
		s.prod.Close()
		return nil, err
	}
	s.lg.Info("sharing the CEs", "topic", rc.CETopic, "partitions", rc.CEPartitions, "group", group, "advertise_url", adv)
	return s, nil
}

func (s *share) close() error { return errors.Join(s.prod.Close(), s.dir.Close()) }

// run is the member of the CE group until ctx ends.
func (s *share) run(ctx context.Context) error {
	s.stopping = ctx
	return s.member.Run(ctx)
}

// Acquire is ceshare.Hooks: partition p is read from the offset the ledger applied. Partitions
// the ledger still holds from before a restart and that the group gave to others are released
// first: this replica must not confirm, audit or publish for CEs it does not own.
func (s *share) Acquire(ctx context.Context, p int) (int64, error) {
	off, ok, err := s.d.ledger.ShareOffset(p)
	if err != nil {
		return 0, err
	}
	s.d.rep.m.CEPartitions.Set(float64(len(s.member.Owned())))
	s.lg.Info("CE partition acquired", "partition", p, "from", off, "held_before", ok)
	return off, nil
}

// Release is ceshare.Hooks: partition p's CEs leave this ledger (their new owner rebuilds them
// from the CE topic). A release cut short leaves p's offset at 0 (ledger.ReleaseShare), and a
// restart that is not given p back releases it again (MemberConfig.Held).
func (s *share) Release(ctx context.Context, p int) error {
	if s.stopping != nil && s.stopping.Err() != nil {
		// The replica stops: its ledger keeps the partition, and a restart that gets it back
		// resumes from there instead of the CE topic's start.
		return nil
	}
	n, err := s.d.ledger.ReleaseShare(ctx, p, func(id string) bool { return ceshare.Partition(id, s.partitions) == p })
	if err != nil {
		return err
	}
	s.d.rep.m.CEPartitions.Set(float64(len(s.member.Owned())))
	s.lg.Info("CE partition released", "partition", p, "counterfactuals", n)
	return nil
}

// Apply is ceshare.Hooks: registrations and deletions of partition p, in order, into the
// ledger; then the offset after them. Applying a request twice (after a crash between the two
// writes) changes nothing: a registration of a stored id is skipped, a deletion of a missing
// one too.
func (s *share) Apply(ctx context.Context, p int, reqs []ceshare.Request, next int64) error {
	var regs []*ledger.CE
	flush := func() error {
		if len(regs) == 0 {
			return nil
		}
		err := s.store(ctx, regs)
		regs = nil
		return err
	}
	for _, r := range reqs {
		switch r.Kind {
		case ceshare.KindRegister:
			var ce measured
			if err := json.Unmarshal(r.CE, &ce); err != nil {
				s.lg.Error("CE registration skipped: its CE does not decode", "partition", p, "id", r.ID, "err", err)
				continue
			}
			// What the owner's ledger judges is its own to fill in.
			regs = append(regs, &ledger.CE{ID: r.ID, X: ce.X, XCF: ce.XCF, Target: ce.Target, AnchorVersion: ce.AnchorVersion,
				P1: ce.P1, Var1: ce.Var1, Samples: ce.Samples, Delta: ce.Delta, Epsilon: ce.Epsilon, CreatedAt: r.At})
		case ceshare.KindDelete:
			if err := flush(); err != nil {
				return err
			}
			err := s.d.durably(ctx, func() error { return s.d.ledger.Delete(r.ID) })
			if err != nil && !errors.Is(err, ledger.ErrNotFound) {
				return err
			}
		}
	}
	if err := flush(); err != nil {
		return err
	}
	if err := s.d.durably(ctx, func() error { return s.d.ledger.SetShareOffset(p, next) }); err != nil {
		return err
	}
	s.d.rep.m.CEApplied.Add(float64(len(reqs)))
	s.d.confirm.notify()
	return nil
}

// store puts registrations into the ledger, each anchored to the posterior it was measured
// under: the current one, a live anchor, or a past version taken from the posterior log
// (replica.past). A CE measured under a version this replica has not applied yet waits for it
// (at most awaitOwner); one whose version it still lacks then is measured again under the
// current posterior, as a registration here would be.
func (s *share) store(ctx context.Context, ces []*ledger.CE) error {
	d := s.d
	newest := uint64(0)
	for _, ce := range ces {
		newest = max(newest, ce.AnchorVersion)
	}
	s.awaitVersion(ctx, newest)
	again, err := s.put(ctx, ces, nil)
	if err != nil || len(again) == 0 {
		return err
	}
	// The past posteriors are found without d.mu: finding one may mean playing the log.
	cur := d.current().Version
	var versions []uint64
	for _, ce := range again {
		if ce.AnchorVersion < cur {
			versions = append(versions, ce.AnchorVersion)
		}
	}
	past, err := d.rep.past(ctx, versions)
	if err != nil {
		return err
	}
	if again, err = s.put(ctx, again, past); err != nil || len(again) == 0 {
		return err
	}
	return d.durably(ctx, func() error {
		d.mu.Lock()
		defer d.mu.Unlock()
		m := d.current()
		pool, err := d.pools.get(m)
		if err != nil {
			return err
		}
		rows := make([][]float64, len(again))
		for i, ce := range again {
			rows[i] = ce.XCF
		}
		pr, err := predictSplit(ctx, pool, rows)
		if err != nil {
			return err
		}
		for i, ce := range again {
			s.lg.Warn("CE measured again under the current posterior: the one it was measured under is not in the posterior log here",
				"id", ce.ID, "anchor_version", ce.AnchorVersion, "posterior_version", m.Version)
			ce.AnchorVersion, ce.P1, ce.Var1, ce.Samples = m.Version, pr.P(i, ce.Target), pr.V(i, ce.Target), d.cfg.Certify.Samples
		}
		errs, err := d.ledger.PutEach(ctx, again)
		if err != nil {
			return err
		}
		s.refused(again, errs)
		return nil
	})
}

// put stores ces with the given past posteriors (ledger.PutPast) under d.mu, so that no
// posterior is committed between the ledger's judgement and its write, and returns those
// refused for their anchor.
func (s *share) put(ctx context.Context, ces []*ledger.CE, past map[uint64]*bnn.Model) ([]*ledger.CE, error) {
	d := s.d
	var again []*ledger.CE
	err := d.durably(ctx, func() error {
		d.mu.Lock()
		defer d.mu.Unlock()
		errs, err := d.ledger.PutPast(ctx, ces, past)
		if err != nil {
			return err
		}
		again = s.refused(ces, errs)
		return nil
	})
	return again, err
}

// refused returns the CEs refused for their anchor (ledger.ErrUnknownAnchor) and logs those
// refused for another reason; one already stored (a request applied twice) is no refusal.
func (s *share) refused(ces []*ledger.CE, errs []error) []*ledger.CE {
	var out []*ledger.CE
	for i, e := range errs {
		switch {
		case e == nil, errors.Is(e, ledger.ErrExists):
		case errors.Is(e, ledger.ErrUnknownAnchor):
			out = append(out, ces[i])
		default:
			s.lg.Error("CE registration refused by the ledger", "id", ces[i].ID, "err", e)
		}
	}
	return out
}

// awaitVersion waits until this replica has applied posterior version v, at most awaitOwner.
func (s *share) awaitVersion(ctx context.Context, v uint64) {
	ctx, cancel := context.WithTimeout(ctx, awaitOwner)
	defer cancel()
	for s.d.current().Version < v {
		if s.d.rep.waitChange(ctx) != nil {
			return
		}
	}
}

// measured is a registration as the replica that accepted it measured it: the CE of a register
// request on the CE topic. Its owner judges the rest (status, bounds).
type measured struct {
	X             []float64 `json:"x"`
	XCF           []float64 `json:"x_cf"`
	Target        int       `json:"target"`
	AnchorVersion uint64    `json:"anchor_version"`
	P1            float64   `json:"p1"`
	Var1          float64   `json:"var1"`
	Samples       int       `json:"samples"`
	Delta         float64   `json:"delta"`
	Epsilon       float64   `json:"epsilon"`
}

// send puts registrations on the CE topic, one request each; errs[i] is ces[i]'s outcome.
func (s *share) send(ctx context.Context, ces []*ledger.CE) []error {
	errs := make([]error, len(ces))
	for i, ce := range ces {
		if ce.ID == "" {
			ce.ID = ledger.NewID()
		}
		raw, err := json.Marshal(measured{X: ce.X, XCF: ce.XCF, Target: ce.Target, AnchorVersion: ce.AnchorVersion, P1: ce.P1,
			Var1: ce.Var1, Samples: ce.Samples, Delta: ce.Delta, Epsilon: ce.Epsilon})
		if err != nil {
			errs[i] = err
			continue
		}
		if _, _, err := s.prod.Send(ctx, ceshare.Request{Kind: ceshare.KindRegister, ID: ce.ID, CE: raw, Replica: s.id, At: time.Now().UTC()}); err != nil {
			errs[i] = fmt.Errorf("%w: the registration could not be sent to the CE topic: %v", ledger.ErrWrite, err)
		}
	}
	return errs
}

// errPending: a registration was sent, and its owner has not stored it yet.
var errPending = errors.New("registration accepted; its owner has not stored it yet")

// await waits until the owner of want's id stores it and returns the CE as stored there; a CE
// of that id with other x, x_cf or target is a conflict (ledger.ErrExists).
func (s *share) await(ctx context.Context, want *ledger.CE) (*ledger.CE, error) {
	ctx, cancel := context.WithTimeout(ctx, awaitOwner)
	defer cancel()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		ce, _, err := s.find(ctx, want.ID, "")
		switch {
		case err == nil && (!slices.Equal(ce.X, want.X) || !slices.Equal(ce.XCF, want.XCF) || ce.Target != want.Target):
			return nil, fmt.Errorf("%w: %q holds another counterfactual", ledger.ErrExists, want.ID)
		case err == nil:
			return ce, nil
		}
		select {
		case <-ctx.Done():
			return want, errPending
		case <-t.C:
		}
	}
}

// find returns the CE id from its owner: this ledger when it owns id's partition, else the
// owner's API (forwarding the request's Authorization). replica names who answered.
func (s *share) find(ctx context.Context, id, authorization string) (ce *ledger.CE, replica string, err error) {
	p := ceshare.Partition(id, s.partitions)
	if slices.Contains(s.member.Owned(), p) {
		ce, err := s.d.ledger.Get(id)
		return ce, s.id, err
	}
	owner, err := s.dir.Owner(ctx, id)
	if err != nil {
		return nil, "", err
	}
	if owner.Replica == s.id {
		ce, err := s.d.ledger.Get(id)
		return ce, s.id, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, owner.URL+"/v1/counterfactuals/"+url.PathEscape(id), nil)
	if err != nil {
		return nil, "", err
	}
	if authorization == "" && s.d.cfg.HTTP.Token != "" {
		authorization = "Bearer " + s.d.cfg.HTTP.Token
	}
	if authorization != "" {
		req.Header.Set("Authorization", authorization)
	}
	req.Header.Set(headerForwarded, s.id)
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, "", fmt.Errorf("asking %s (%s), the owner of partition %d: %w", owner.Replica, owner.URL, p, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, "", err
	}
	switch resp.StatusCode {
	case http.StatusOK:
		var got ledger.CE
		if err := json.NewDecoder(bytes.NewReader(body)).Decode(&got); err != nil {
			return nil, "", fmt.Errorf("%s's answer: %w", owner.Replica, err)
		}
		return &got, owner.Replica, nil
	case http.StatusNotFound:
		return nil, owner.Replica, fmt.Errorf("%w: %q", ledger.ErrNotFound, id)
	}
	return nil, owner.Replica, fmt.Errorf("%s, the owner of partition %d, answered %d: %s", owner.Replica, p, resp.StatusCode, bytes.TrimSpace(body))
}

// headerForwarded marks a request one replica forwards to another, naming the sender; the
// owner answers from its ledger and never forwards it again.
const headerForwarded = "Cfguard-Forwarded-By"

// forget sends a deletion of id to its owner, after checking that it is stored.
func (s *share) forget(ctx context.Context, id string) error {
	if _, _, err := s.find(ctx, id, ""); err != nil {
		return err
	}
	_, _, err := s.prod.Send(ctx, ceshare.Request{Kind: ceshare.KindDelete, ID: id, Replica: s.id, At: time.Now().UTC()})
	return err
}
