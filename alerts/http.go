package alerts

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// Names of the API server's metrics: the connections it holds, the requests it answers and
// those it sheds.
const (
	NameHTTPConnections    = "cfguard_http_connections"
	NameHTTPMaxConnections = "cfguard_http_max_connections"
	NameHTTPRequests       = "cfguard_http_requests_total"
	NameHTTPRejected       = "cfguard_http_requests_rejected_total"
)

// Route is a bounded route of the API, the label set of cfguard_http_requests_rejected_total.
type Route string

// Routes whose concurrent requests are bounded.
const (
	RoutePredict Route = "predict" // http.max_predict_inputs
	RouteExplain Route = "explain" // explain.concurrency
)

// HTTPMetrics are the API server's metrics.
type HTTPMetrics struct {
	// Connections is the number of connections the API holds open.
	Connections prometheus.Gauge
	requests    *prometheus.CounterVec
	rejected    *prometheus.CounterVec
}

// NewHTTPMetrics registers the API server's metrics on reg; maxConns is http.max_connections.
func NewHTTPMetrics(reg prometheus.Registerer, maxConns int) *HTTPMetrics {
	f := promauto.With(reg)
	m := &HTTPMetrics{
		Connections: f.NewGauge(prometheus.GaugeOpts{Name: NameHTTPConnections,
			Help: "Connections the API holds open (at most http.max_connections)."}),
		requests: f.NewCounterVec(prometheus.CounterOpts{Name: NameHTTPRequests,
			Help: "Requests answered, by route (the API's pattern, \"ui\" for the web UI, \"other\" for a path no route takes) and status code."}, []string{"route", "code"}),
		rejected: f.NewCounterVec(prometheus.CounterOpts{Name: NameHTTPRejected,
			Help: "Requests answered 429 because their route had no room for them (predict: the inputs admitted plus theirs would pass http.max_predict_inputs; explain: every explain.concurrency slot was taken)."}, []string{"route"}),
	}
	f.NewGauge(prometheus.GaugeOpts{Name: NameHTTPMaxConnections, Help: "http.max_connections."}).Set(float64(maxConns))
	for _, r := range []Route{RoutePredict, RouteExplain} {
		m.rejected.WithLabelValues(string(r))
	}
	return m
}

// Requests is the counter of the requests to route answered, by status code (label "code", as
// promhttp.InstrumentHandlerCounter sets it).
func (m *HTTPMetrics) Requests(route string) *prometheus.CounterVec {
	return m.requests.MustCurryWith(prometheus.Labels{"route": route})
}

// Rejected is the counter of requests to route answered 429.
func (m *HTTPMetrics) Rejected(r Route) prometheus.Counter {
	return m.rejected.WithLabelValues(string(r))
}
