package alerts

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// Names of the API server's metrics: the connections it holds and the requests it sheds.
const (
	NameHTTPConnections    = "cfguard_http_connections"
	NameHTTPMaxConnections = "cfguard_http_max_connections"
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
	rejected    *prometheus.CounterVec
}

// NewHTTPMetrics registers the API server's metrics on reg; maxConns is http.max_connections.
func NewHTTPMetrics(reg prometheus.Registerer, maxConns int) *HTTPMetrics {
	f := promauto.With(reg)
	m := &HTTPMetrics{
		Connections: f.NewGauge(prometheus.GaugeOpts{Name: NameHTTPConnections,
			Help: "Connections the API holds open (at most http.max_connections)."}),
		rejected: f.NewCounterVec(prometheus.CounterOpts{Name: NameHTTPRejected,
			Help: "Requests answered 429 because their route had no room for them (predict: the inputs admitted plus theirs would pass http.max_predict_inputs; explain: every explain.concurrency slot was taken)."}, []string{"route"}),
	}
	f.NewGauge(prometheus.GaugeOpts{Name: NameHTTPMaxConnections, Help: "http.max_connections."}).Set(float64(maxConns))
	for _, r := range []Route{RoutePredict, RouteExplain} {
		m.rejected.WithLabelValues(string(r))
	}
	return m
}

// Rejected is the counter of requests to route answered 429.
func (m *HTTPMetrics) Rejected(r Route) prometheus.Counter {
	return m.rejected.WithLabelValues(string(r))
}
