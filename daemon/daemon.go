package daemon

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/exporter-toolkit/web"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/hooks"
	"github.com/cfguard/cfguard/internal/atomicfile"
	"github.com/cfguard/cfguard/internal/episode"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/replica"
	"github.com/cfguard/cfguard/stream"
	"github.com/cfguard/cfguard/ui"
)

// Options are what Run needs from its caller.
type Options struct {
	Config *config.Config
	Logger *slog.Logger
	// Registry receives the daemon's metrics and is served on /metrics. Default: a new registry.
	Registry *prometheus.Registry
	// Ready, when set, receives the daemon once its API serves (tests use it to find addresses).
	Ready chan<- *Daemon
	// ConfigPath is the configuration file's path, for the commands error messages print.
	// Default: config.yaml.
	ConfigPath string
	// AcceptTopicReset is the operator's confirmation that kafka.topic was reset (deleted and
	// recreated, or records lost by the broker): a partition that no longer holds the ledger's
	// offset is read from its log start, and that offset checkpointed
	// (stream.ConsumerConfig.AcceptTopicReset). Without it such a partition stops ingest.
	AcceptTopicReset bool
	// HTTPListener and BrokerListener, when set, are sockets already listening on http.listen
	// and, with the embedded broker, kafka.embedded_listen: the daemon serves on them instead of
	// binding those addresses, and closes them (also when Run fails). A caller that stops and
	// starts a daemon on the same addresses holds the ports across the restarts (the tests do,
	// with internal/testnet).
	HTTPListener, BrokerListener net.Listener
	// BundledModel, when set, stands in for training the bundled model at a first start without
	// model.path: it returns the network that model.dataset, model.seed and model.epochs trained
	// before (training is deterministic), for a program that runs many daemons on the same keys
	// (the tests train it once per process, not once per daemon).
	BundledModel func() (*bnn.Model, error)

	// Hooks, when set, are the points at which a test steps into the daemon (package hooks is
	// internal to daemon, so only code under daemon can make a Set); nil is a daemon's normal
	// behaviour.
	Hooks *hooks.Set
}

// Daemon is a running cfguard. Its exported methods are safe for concurrent use.
type Daemon struct {
	cfg     *config.Config
	log     *slog.Logger
	reg     *prometheus.Registry
	metrics *alerts.Metrics
	ledger  *ledger.Ledger
	pools   *pools // the current posterior version's shared Monte-Carlo draws
	conn    stream.ConnConfig
	pub     *stream.Publisher
	policy  certify.Policy
	budget  float64 // KL budget of one update, (0.5 - delta)^2 / 2

	hooks hooks.Set // *Options.Hooks; the audit's set by tests before an audit starts
	// bundledModel is Options.BundledModel.
	bundledModel func() (*bnn.Model, error)

	configPath       string
	acceptTopicReset bool

	httpAddr   net.Addr
	brokerAddr []string
	httpLn     net.Listener   // bound by bind, served by serve
	front      *front         // the HTTP server's handler: the phase of the start, then the API
	brokerLn   net.Listener   // bound by bind for the embedded broker, which takes it over
	broker     *broker.Broker // the embedded broker, nil with kafka.brokers

	// mu serialises posterior transitions (increments, audits) with registrations, so that a
	// CE is always anchored to the posterior that is current when it is stored.
	mu  sync.Mutex
	cur *bnn.Model // guarded by mu for writes; read with current()
	rmu sync.RWMutex
	// promoted is closed when cur changes, and replaced (under rmu): awaitVersion waits on it.
	promoted chan struct{}
	// served keeps the last posteriors cur held, for the confirmer to measure a lapsed
	// certificate under the version it lapsed at.
	served *recent
	// recalled is closed once a replica has recalled the posteriors it served before its start
	// (recallServed), nil on a single node; its confirmers wait for it until recallBy, and
	// recallLate logs once that they stopped waiting.
	recalled   chan struct{}
	recallBy   time.Time
	recallLate sync.Once
	// published pairs a promoted posterior with the checkpoint that stores it: apply holds it
	// for writing from the ledger commit to the swap of cur, and a reader that reports ledger
	// state beside the posterior holds it for reading (snapshot), so it sees both before or both
	// after an increment, never the ledger's new version beside the old posterior. current()
	// does not take it: a reader of the posterior alone never waits for a commit.
	published sync.RWMutex

	registrar *registrar // group commit of registrations (storeRegistrations)
	exp       *explainer
	audits    auditor
	files     posteriorCache
	export    *exporter

	outbox *outboxPublisher // publishes the ledger's outbox to kafka.events_topic
	// publishing is the outbox publisher's state while its attempts fail (nil while they work),
	// which the UI's events page shows; it outlives the publisher, made after the API serves.
	publishing atomic.Pointer[ui.Publishing]
	confirm    confirmers                       // Monte-Carlo verdicts for CEs whose bound fails, in the background, in lanes
	reissue    *reissuer                        // new CEs for those that reach explain.reissue's status
	batch      *batcher                         // POST /v1/predict requests served together, one engine call a batch
	writeFail  [len(heldWrites)]episode.Episode // by heldWrite.kind: running while such writes fail with ledger.ErrWrite (degraded mode: durably)
	ends       topicEnds                        // the input topic's watermarks as last read (waiting.go)

	// requests counts the requests applied before (request ids): skipped, and answered from
	// their outcome.
	requests *alerts.RequestMetrics

	rep    *replica.Replica // with replication.enabled: the posterior log's follower and updater
	share  *cluster.Share   // with replication.enabled: the CEs this replica owns (set by Run once the API is bound)
	states *cluster.States  // with replication.enabled: CE states to the CE state topic

	quality *prequential // the served model's test-then-train scores and change detector

	ready         chan struct{}    // closed once the consumer runs (or ingest stayed stopped)
	consumer      *stream.Consumer // set before ready is closed unless ingestStopped; its Health answers /readyz
	ingestStopped error            // set before ready is closed: an unconfirmed topic reset keeps ingest stopped
}

// HTTPAddr is the API's listening address.
func (d *Daemon) HTTPAddr() string { return d.httpAddr.String() }

// BrokerAddrs are the Kafka bootstrap addresses in use (the embedded broker's, when embedded).
func (d *Daemon) BrokerAddrs() []string { return append([]string(nil), d.brokerAddr...) }

// Posterior is the posterior the daemon serves now.
func (d *Daemon) Posterior() *bnn.Model { return d.current() }

// Ledger is the daemon's ledger: its posteriors, CEs, offsets and outbox.
func (d *Daemon) Ledger() *ledger.Ledger { return d.ledger }

// Replica is the daemon's place in the posterior log (follower and updater); nil without
// replication.enabled.
func (d *Daemon) Replica() *replica.Replica { return d.rep }

// Share is the CE share this replica owns; nil without replication.enabled.
func (d *Daemon) Share() *cluster.Share { return d.share }

// Consumer is the daemon's consumer of kafka.topic: its counts (Stats) and its health, which
// /readyz reports.
func (d *Daemon) Consumer() *stream.Consumer { return d.consumer }

func (d *Daemon) current() *bnn.Model {
	d.rmu.RLock()
	defer d.rmu.RUnlock()
	return d.cur
}

// metricsState is state with the time the KL budget was last breached (LastBreach) and the time
// an update last failed (LastFailed), which the ledger reads in a transaction of its own
// (LastKLEvents): each is an event with a time, so that an alert on it can end a fixed time after the
// last one, with no update to clear it.
func (d *Daemon) metricsState() (alerts.State, error) {
	s, err := d.state()
	if err != nil {
		return s, err
	}
	ev, err := d.ledger.LastKLEvents(d.budget)
	if err != nil {
		return alerts.State{}, err
	}
	if ev.Breach != nil {
		s.LastBreach = ev.Breach.At
	}
	if ev.Failed != nil {
		s.LastFailed = ev.Failed.At
	}
	return s, nil
}

func (d *Daemon) setCurrent(m *bnn.Model) {
	d.served.add(m)
	d.rmu.Lock()
	d.cur = m
	if d.promoted != nil {
		close(d.promoted)
	}
	d.promoted = make(chan struct{})
	d.rmu.Unlock()
}

// awaitVersion returns the current posterior once its version is at least v, or the current
// one when ctx ends first; errPredictStopping when the daemon stops meanwhile (its predictor
// stops taking calls), so that a waiting prediction does not hold the stop up.
func (d *Daemon) awaitVersion(ctx context.Context, v uint64) (*bnn.Model, error) {
	for first := true; ; first = false {
		d.rmu.RLock()
		m, promoted := d.cur, d.promoted
		d.rmu.RUnlock()
		if m.Version >= v || promoted == nil {
			return m, nil
		}
		if first && d.hooks.PredictAwait != nil {
			d.hooks.PredictAwait(v)
		}
		select {
		case <-promoted:
		case <-ctx.Done():
			return d.current(), nil
		case <-d.batch.stopped:
			return d.current(), errPredictStopping
		}
	}
}

// snapshot runs read with the current posterior while no promotion is between its checkpoint and
// the swap of the posterior (see published), so that the ledger state read reads belongs to m.
// read must not write to the ledger or take d.mu.
func (d *Daemon) snapshot(read func(m *bnn.Model) error) error {
	d.published.RLock()
	defer d.published.RUnlock()
	return read(d.current())
}

// Run starts the daemon and blocks until ctx is cancelled or a component fails. Resources are
// released in reverse order of acquisition (teardown), each registered right after it was
// acquired.
func Run(ctx context.Context, opts Options) (err error) {
	d, err := newDaemon(opts)
	if err != nil {
		for _, ln := range []net.Listener{opts.HTTPListener, opts.BrokerListener} {
			if ln != nil {
				ln.Close()
			}
		}
		return err
	}
	// life outlives the components: the broker and the publisher stop in teardown, after every
	// component has returned, so the consumer never reads from a broker that is going away.
	life, stopLife := context.WithCancel(context.WithoutCancel(ctx))
	defer stopLife()
	td := teardown{log: d.log}
	defer func() {
		d.front.setPhase("stopping") // a start that ends: its answers say so while teardown runs
		if terr := td.run(); terr != nil {
			err = errors.Join(err, terr)
		}
	}()
	defer func() { // before the teardown's: a failure of the teardown is still returned
		if errors.Is(err, errStoppedAtStart) { // asked to stop before it served: a clean stop
			err = nil
		}
	}()
	// Every listener is bound before any state is created or a model trained: a busy port stops
	// the start with state_dir untouched.
	if err := d.bind(&td); err != nil {
		return err
	}
	// From here on the port answers: 503 naming the phase of the start (front), then the API.
	web, hm := d.startServing()
	td.add("HTTP server", web.close)
	if err := d.openState(ctx, &td); err != nil {
		return err
	}
	d.front.setPhase("connecting to Kafka")
	if err := d.connectKafka(life, &td); err != nil {
		return err
	}
	if d.rep != nil {
		err := d.joinLog(ctx)
		td.add("posterior log", d.rep.Close)
		if se := (*replica.SettingsError)(nil); errors.As(err, &se) {
			return d.refuse(ctx, se, web, hm, opts.Ready)
		}
		if err != nil {
			return err
		}
	}
	d.export = newExporter(d.cfg.ExportDir(), &d.files, d.current, d.log.With("component", "export"), d.metrics)
	if d.rep != nil {
		if err := d.joinShare(ctx, life); err != nil {
			return err
		}
		td.add("CE share", d.share.Close)
	}

	d.front.setPhase("reading the input topic's offsets")
	ends, err := stream.NewOffsetsReader(life, d.conn, d.cfg.Kafka.Topic)
	if err != nil {
		return err
	}
	td.add("input topic offsets reader", func() error { ends.Close(); return nil })
	d.readEnds(ctx, ends)

	// The components. The first to fail cancels the others; Run returns its error.
	g := newGroup(ctx, d.log)
	d.serveAPI(d.newAPI(hm).routes())
	g.Go("http", web.run)
	if d.rep != nil {
		close(d.ready)
		g.Go("follow", d.rep.Follow)
		g.Go("recall", d.recallServed)
		g.Go("points", d.wakeOnPoints)
		g.Go("updater", d.rep.RunUpdaterGroup)
		g.Go("ceshare", d.share.Run)
	} else {
		g.Go("ingest", d.ingest)
	}
	g.Go("register", d.registrar.run)
	g.Go("outbox", d.outbox.run)
	g.Go("confirm", d.confirm.run)
	g.Go("audit", d.auditSchedule)
	g.Go("explain", d.exp.run)
	g.Go("reissue", d.reissue.run)
	g.Go("predict", d.batch.run)
	g.Go("export", d.export.run)
	g.Go("watermarks", func(ctx context.Context) error { return d.watchTopic(ctx, ends) })
	if opts.Ready != nil {
		opts.Ready <- d
	}
	// Shutdown: the HTTP server drains for http.shutdown_timeout; an increment in flight is
	// abandoned (not checkpointed, not committed: the restart redoes it) or finished.
	return g.Wait(d.cfg.HTTP.ShutdownTimeout + 5*time.Second)
}

// newDaemon validates the configuration and builds what needs no I/O.
func newDaemon(opts Options) (*Daemon, error) {
	cfg := opts.Config
	if cfg == nil {
		return nil, errors.New("daemon: no configuration")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	// web.Serve would find a bad web configuration only once serving, after training: say so
	// before any work.
	if err := cfg.CheckWebConfig(); err != nil {
		return nil, err
	}
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	reg := opts.Registry
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	d := &Daemon{cfg: cfg, log: log, reg: reg, served: newRecent(recentPosteriors), metrics: alerts.NewMetrics(reg), budget: certify.KLBudget(cfg.Certify.Delta),
		policy: certify.Policy{Mode: cfg.Certify.Mode, EpsilonMax: cfg.Certify.EpsilonMax, Hoeffding: cfg.Certify.HoeffdingAlpha > 0, Alpha: alphaOr(cfg.Certify.HoeffdingAlpha)},
		ready:  make(chan struct{}), pools: &pools{samples: cfg.Certify.Samples, prec: cfg.Certify.Precision},
		configPath: cmp.Or(opts.ConfigPath, "config.yaml"), acceptTopicReset: opts.AcceptTopicReset,
		httpLn: opts.HTTPListener, brokerLn: opts.BrokerListener, front: newFront(),
		bundledModel: opts.BundledModel}
	if opts.Hooks != nil {
		d.hooks = *opts.Hooks
	}
	reg.MustRegister(alerts.NewStateCollector(d.budget, d.metricsState))
	d.requests = alerts.NewRequestMetrics(reg)
	d.quality = newPrequential(alerts.NewQualityMetrics(reg))
	d.batch = newBatcher(runtime.GOMAXPROCS(0), d.predictNow)
	d.registrar = newRegistrar(runtime.GOMAXPROCS(0), d.measureRegistrations, d.storeRegistrations)
	d.exp = newExplainer(explainerConfig{stateDir: cfg.StateDir, dataset: cfg.Model.Dataset, seed: cfg.Model.Seed,
		maxIterations: cfg.Explain.MaxIterations, concurrency: cfg.Explain.Concurrency, delta: cfg.Certify.Delta,
		epsilon: cfg.Certify.Epsilon, targetAlpha: cfg.Certify.VerdictAlpha, pool: d.pools.get}, d.current, log.With("component", "explain"))
	return d, nil
}

// openState opens the ledger (refusing a damaged or locked one) and sets the current posterior
// (bootstrapModel); a replica sets it from the posterior log later (replica.Replica.Join).
func (d *Daemon) openState(ctx context.Context, td *teardown) (err error) {
	var encodeState func(*ledger.CE) (ledger.OutboxEntry, error)
	if d.cfg.Replication.Enabled {
		// Named before the ledger opens: Open may rewrite CEs (a policy change, a quarantine) and
		// put their states in the outbox, and a state must name its writer.
		id, err := replica.ID(d.cfg.Replication.ReplicaID)
		if err != nil {
			return err
		}
		d.states = cluster.NewStates(id, d.log.With("component", "ce-states"))
		encodeState = d.states.Encode
	}
	var origin string // a replica's posterior comes from the posterior log, not model.*
	if !d.cfg.Replication.Enabled {
		if origin, err = configOrigin(d.cfg); err != nil {
			return err
		}
	}
	d.front.setPhase("opening the ledger")
	d.ledger, err = ledger.Open(d.cfg.StateDir, ledger.Options{Policy: d.policy, Logger: d.log, EncodeChange: encodeChange, MCBatch: backgroundBatch,
		Reissue:       parseReissueRule(d.cfg.Explain.Reissue).ledgerOption(),
		RequestWindow: d.cfg.HTTP.IdempotencyWindow, EncodeState: encodeState, Origin: origin,
		VerdictAlpha: d.cfg.Certify.VerdictAlpha, AdmitByEvidence: true, AfterCommit: d.hooks.LedgerAfterCommit, Past: d.served.at})
	var refused *ledger.OriginError
	if errors.As(err, &refused) {
		return d.originRefused(refused.Have, refused.Want)
	}
	if err != nil {
		return err
	}
	td.add("ledger", d.ledger.Close)
	alerts.RegisterDamaged(d.reg, d.ledger.Damaged)
	alerts.RegisterLedgerWriteFailures(d.reg, func() (uint64, time.Time) { f := d.ledger.WriteFailures(); return f.Count, f.At },
		func() bool { return d.ledgerHealth(time.Now()) != nil })
	if err := d.quality.load(d.ledger); err != nil {
		return fmt.Errorf("ledger %s: %w (move the ledger aside and restore a backup: cfguard restore --config %s --from BACKUP)",
			d.ledger.Path(), err, d.configPath)
	}
	if d.cfg.Replication.Enabled {
		// The posterior comes from the posterior log (Replica.Join), once Kafka is connected.
		d.rep, err = replica.New(replica.Options{Config: d.cfg, ConfigPath: d.configPath, Registry: d.reg,
			Logger: d.log, Host: replicaHost{d}, Ledger: d.ledger, CaughtUp: d.hooks.UpdaterCaughtUp})
		if err != nil {
			return err
		}
		d.recalled, d.recallBy = make(chan struct{}), time.Now().Add(cmp.Or(d.hooks.RecallWait, recallWait))
		d.states.SetMetrics(d.rep.Metrics()) // its replica was named before the ledger opened, as replica.New names it
		return nil
	}
	return d.bootstrapModel(ctx)
}

// embeddedClientIdle is how long the daemon's Kafka clients keep an idle connection to the
// embedded broker at most (kafka-go's default); half kafka.embedded_idle_timeout when that is less.
const embeddedClientIdle = 30 * time.Second

// connectKafka starts the embedded broker when no kafka.brokers are configured, and the event
// publisher, the outbox and the confirmer that depend on it.
func (d *Daemon) connectKafka(life context.Context, td *teardown) error {
	cfg, log := d.cfg, d.log
	tlsCfg, err := stream.LoadTLS(stream.TLSFiles(cfg.Kafka.TLS))
	if err != nil {
		return err
	}
	d.conn = stream.ConnConfig{Brokers: cfg.Kafka.Brokers, TLS: tlsCfg, ClientID: cfg.Kafka.ClientID}
	if cfg.Kafka.SASL.Mechanism != "" {
		d.conn.SASL = &stream.SASL{Mechanism: cfg.Kafka.SASL.Mechanism, User: cfg.Kafka.SASL.Username, Password: cfg.Kafka.SASL.Password}
	}
	if cfg.Embedded() {
		// SyncWrites: a produce is acknowledged only once on disk, so acknowledged records survive
		// a crash of the daemon (and of the broker inside it).
		// Created here so that its entry in state_dir is durable (the broker's own mkdir is not).
		brokerDir := filepath.Join(cfg.StateDir, "broker")
		if err := atomicfile.MkdirAll(brokerDir); err != nil {
			return fmt.Errorf("embedded broker: %w", err)
		}
		b, err := broker.Start(life, broker.Config{Listen: cfg.Kafka.EmbeddedListen, Listener: d.brokerLn, DataDir: brokerDir, SyncWrites: true,
			Topics: []string{cfg.Kafka.Topic, cfg.Kafka.DeadLetterTopic, cfg.Kafka.EventsTopic}, Partitions: 1,
			Retention: cfg.Kafka.EmbeddedRetention, RetentionBytes: cfg.Kafka.EmbeddedRetentionBytes,
			MaxConnections: cfg.Kafka.EmbeddedMaxConnections, IdleTimeout: cfg.Kafka.EmbeddedIdleTimeout,
			RequestTimeout: cfg.Kafka.EmbeddedRequestTimeout}, log.With("component", "broker"))
		if err != nil {
			return fmt.Errorf("embedded broker on kafka.embedded_listen %s: %w", cfg.Kafka.EmbeddedListen, err)
		}
		td.add("embedded broker", func() error { b.Close(); return nil })
		d.broker = b
		RegisterBrokerMetrics(d.reg, b)
		d.conn.Brokers, d.conn.TLS, d.conn.SASL = b.Addrs(), nil, nil
		// Our clients drop idle connections before the broker closes them under them.
		d.conn.IdleTimeout = min(embeddedClientIdle, cfg.Kafka.EmbeddedIdleTimeout/2)
	}
	d.brokerAddr = d.conn.Brokers

	d.pub, err = stream.NewPublisher(life, stream.PublisherConfig{Conn: d.conn, Topic: cfg.Kafka.EventsTopic}, log.With("component", "events"))
	if err != nil {
		return err
	}
	td.add("event publisher", d.pub.Close)
	var replicaID string
	if d.rep != nil {
		replicaID = d.rep.ID()
	}
	d.outbox = newOutboxPublisher(d.ledger, d.pub, d.metrics, replicaID, log.With("component", "outbox"))
	d.outbox.state = &d.publishing
	d.outbox.before = d.hooks.OutboxPublish
	if d.states != nil {
		rc := cfg.Replication
		w, err := ceshare.NewStateWriter(life, d.conn, ceshare.StateTopic(rc.CETopic), rc.CEPartitions, d.rep.Keys())
		if err != nil {
			return err
		}
		td.add("CE state writer", w.Close)
		d.states.SetWriter(w)
		d.outbox.states = d.states
	}
	d.reissue = newReissuer(d, cfg.Explain.Reissue, log.With("component", "reissue"))
	d.confirm = newConfirmers(auditWorkers(cfg.Audit.Workers), d.ledger, d.current, d.pools, d.metrics, func(changes []ledger.StatusChange) {
		d.outbox.notify()
		d.reissue.notify(changes)
	}, log.With("component", "confirm"))
	for _, c := range d.confirm {
		c.beforeRound = d.hooks.ConfirmRound
		c.past = d.served.at
		if d.rep != nil {
			c.points = func() ledger.Points { return d.rep.Head() }
		}
	}
	if cfg.Replication.Enabled {
		d.reissue.gate = func(ctx context.Context) error { return d.awaitShareSettled(ctx, "the reissuer") }
		for _, c := range d.confirm {
			c.gate = func(ctx context.Context) error {
				if err := d.awaitShareSettled(ctx, "the confirmer"); err != nil {
					return err
				}
				return d.awaitRecalled(ctx)
			}
		}
	}
	return nil
}

// startServing serves http.listen, bound by bind, with front: the http.* timeouts, at most
// http.max_connections connections held (so that a flood of slow clients cannot take the file
// descriptors the ledger and the embedded broker need). It returns the HTTP metrics the API
// counts its refusals in (/v1/predict and /v1/explain are bounded).
func (d *Daemon) startServing() (*server, *alerts.HTTPMetrics) {
	cfg := d.cfg
	ln := d.httpLn
	d.httpAddr = ln.Addr()
	hm := alerts.NewHTTPMetrics(d.reg, cfg.HTTP.MaxConnections)
	d.exp.slots.rejected = hm.Rejected(alerts.RouteExplain)
	srv := &http.Server{Handler: d.front, ReadHeaderTimeout: cfg.HTTP.ReadHeaderTimeout,
		ReadTimeout: cfg.HTTP.ReadTimeout, WriteTimeout: cfg.HTTP.WriteTimeout, IdleTimeout: cfg.HTTP.IdleTimeout,
		ErrorLog: slog.NewLogLogger(d.log.With("component", "http").Handler(), slog.LevelWarn)}
	return d.serveOn(srv, newLimitListener(ln, cfg.HTTP.MaxConnections, hm.Connections)), hm
}

// bind binds http.listen and, for the embedded broker, kafka.embedded_listen, unless Options
// gave their sockets. Until the server and the broker take them over, teardown closes them.
func (d *Daemon) bind(td *teardown) error {
	cfg := d.cfg
	if bl := d.brokerLn; bl != nil {
		td.add("embedded broker listener", func() error { bl.Close(); return nil }) // a no-op once the broker closed it
	}
	ln := d.httpLn
	if ln == nil {
		var err error
		if ln, err = net.Listen("tcp", cfg.HTTP.Listen); err != nil {
			return fmt.Errorf("http.listen %s: %w (nothing was written to state_dir %s)", cfg.HTTP.Listen, err, cfg.StateDir)
		}
		d.httpLn = ln
	}
	td.add("http listener", func() error { ln.Close(); return nil }) // a no-op once the server closed it
	if !cfg.Embedded() || d.brokerLn != nil {
		return nil
	}
	bl, err := net.Listen("tcp", cfg.Kafka.EmbeddedListen)
	if err != nil {
		return fmt.Errorf("kafka.embedded_listen %s: %w (nothing was written to state_dir %s)", cfg.Kafka.EmbeddedListen, err, cfg.StateDir)
	}
	d.brokerLn = bl
	td.add("embedded broker listener", func() error { bl.Close(); return nil })
	return nil
}

// loopbackListen reports whether listen (http.listen) binds a loopback address only.
func loopbackListen(listen string) bool {
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return strings.EqualFold(host, "localhost") || ip != nil && ip.IsLoopback()
}

// newAPI builds the API's handlers over the daemon.
func (d *Daemon) newAPI(hm *alerts.HTTPMetrics) *api {
	cfg := d.cfg
	predict := newInputBudget(cfg.HTTP.MaxPredictInputs, maxPredictBatch)
	predict.rejected = hm.Rejected(alerts.RoutePredict)
	return &api{cfg: apiConfig{token: cfg.HTTP.Token, metricsToken: cfg.HTTP.MetricsToken, maxBodyBytes: cfg.HTTP.MaxBodyBytes,
		writeTimeout: cfg.HTTP.WriteTimeout, explainTimeout: cfg.Explain.Timeout, loopback: loopbackListen(cfg.HTTP.Listen), budget: d.budget, delta: cfg.Certify.Delta,
		epsilon: cfg.Certify.Epsilon, epsilonMax: cfg.Certify.EpsilonMax, mode: string(cfg.Certify.Mode), onBreach: string(cfg.Certify.OnBreach),
		verdictAlpha: cfg.Certify.VerdictAlpha, reissue: cfg.Explain.Reissue != "", versionWait: cfg.Replication.RegisterWait,
		replicated: cfg.Replication.Enabled},
		state: d.ledger, backup: d.ledger, core: d, exp: d.exp, predict: predict,
		metrics: promhttp.HandlerFor(d.reg, promhttp.HandlerOpts{Registry: d.reg}), log: d.log, gatherer: d.reg, publishing: &d.publishing,
		httpMetrics: hm}
}

// serveAPI makes h (the API, or a replica's refusal) answer on http.listen from now on.
func (d *Daemon) serveAPI(h http.Handler) {
	d.front.serve(h)
	d.log.Info("HTTP API listening", "addr", d.httpAddr.String(), "web_config_file", d.cfg.HTTP.WebConfigFile)
}

// handlerStopWait bounds how long serve waits, after the drain timed out and every request's
// context was cancelled, for the handlers still running to return.
const handlerStopWait = 5 * time.Second

// serve runs the HTTP server until ctx ends, then drains it for http.shutdown_timeout. With
// http.web_config_file set, the Prometheus exporter-toolkit serves it (web.Serve on the listener
// bound by bind): TLS, client certificates (mTLS) and basic auth as that file says, the file
// and the certificates it names reread on every new connection, so a renewed certificate is
// served without a restart. Without it, plain HTTP.
//
// A request still running when the drain times out has its context cancelled and its
// connection closed, and serve waits (up to handlerStopWait) for its handler to return, so that
// no handler outlives the daemon's stop.
func (d *Daemon) serve(ctx context.Context, srv *http.Server, ln net.Listener) error {
	base, cancelBase := context.WithCancel(context.Background())
	defer cancelBase()
	srv.BaseContext = func(net.Listener) context.Context { return base }
	var running atomic.Int64 // handlers running
	h := srv.Handler
	srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		running.Add(1)
		defer running.Add(-1)
		h.ServeHTTP(w, r)
	})
	unused := newUnusedConns(d.log)
	srv.ConnState = unused.track
	stopped := make(chan error, 1)
	go func() {
		<-ctx.Done()
		sctx, c := context.WithTimeout(context.Background(), d.cfg.HTTP.ShutdownTimeout)
		defer c()
		// Connections a client keeps without using would hold the drain 5 s (unusedConns).
		sweepCtx, stopSweep := context.WithCancel(sctx)
		swept := make(chan struct{})
		go func() { defer close(swept); unused.sweep(sweepCtx) }()
		err := srv.Shutdown(sctx)
		stopSweep()
		<-swept
		if err != nil {
			cancelBase()
			srv.Close()
			for end := time.Now().Add(handlerStopWait); running.Load() > 0 && time.Now().Before(end); {
				time.Sleep(10 * time.Millisecond)
			}
			if n := running.Load(); n > 0 {
				d.log.Warn("requests still running after the HTTP server closed", "handlers", n, "waited", handlerStopWait)
			}
		}
		stopped <- err
	}()
	systemd := false
	flags := &web.FlagConfig{WebListenAddresses: &[]string{d.cfg.HTTP.Listen}, WebSystemdSocket: &systemd, WebConfigFile: &d.cfg.HTTP.WebConfigFile}
	if err := web.Serve(ln, srv, flags, d.log.With("component", "http")); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	if err := <-stopped; err != nil {
		return fmt.Errorf("draining within http.shutdown_timeout %v: %w", d.cfg.HTTP.ShutdownTimeout, err)
	}
	return nil
}

// readiness is /readyz: the daemon has started, the embedded broker (when there is one)
// accepts connections, its checkpoints are being written (not in the degraded mode of durably),
// no commit to the ledger failed within the last minute (ledgerHealth), and its consumer is
// healthy (stream.Health).
func (d *Daemon) readiness(ctx context.Context) error {
	if d.rep != nil {
		if err := d.rep.Refusal(); err != nil {
			return err
		}
	}
	select {
	case <-d.ready:
	default:
		return errors.New("starting")
	}
	if d.broker != nil {
		if err := d.broker.Healthy(); err != nil {
			return err
		}
	}
	if err := d.checkpointHealth(); err != nil {
		return err
	}
	if err := d.ledgerHealth(time.Now()); err != nil {
		return err
	}
	if d.rep != nil {
		if err := d.rep.Health(); err != nil {
			return err
		}
		return d.share.Health()
	}
	if d.ingestStopped != nil {
		return d.ingestStopped
	}
	// The consumer's own traffic keeps its health current: no broker request per probe.
	if h := d.consumer.Health(); !h.Ready {
		return errors.New("consumer not ready: " + strings.Join(h.Reasons, "; "))
	}
	return nil
}

func alphaOr(a float64) float64 {
	if a > 0 {
		return a
	}
	return certify.DefaultAlpha
}

// RegisterBrokerMetrics registers on reg the metrics of an embedded broker b, read at each
// scrape: its failing writes and its connections (alerts.RegisterEmbeddedBrokerWrites,
// alerts.RegisterEmbeddedBrokerConnections). The daemon registers its own broker's; cfguard broker
// --metrics-listen serves the standalone one's.
func RegisterBrokerMetrics(reg prometheus.Registerer, b *broker.Broker) {
	alerts.RegisterEmbeddedBrokerWrites(reg, b.WriteFailing)
	alerts.RegisterEmbeddedBrokerConnections(reg, func() alerts.BrokerConns {
		s := b.Connections()
		return alerts.BrokerConns{Open: s.Open, Max: s.Max, Limit: s.Refused, Idle: s.Idle, Partial: s.Partial, Oversized: s.Oversized, Invalid: s.Invalid}
	})
}
