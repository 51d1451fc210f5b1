// Package alerting runs the shipped Prometheus configuration and alert rules
// (deploy/prometheus/prometheus.yml, alerts/rules.yml) and Alertmanager configuration
// (deploy/prometheus/alertmanager.yml) against a live daemon on loopback, with Debian's
// prometheus and prometheus-alertmanager: an alert reaches Alertmanager and its paging webhook
// after drift; at the default settings no alert fires while correctly labelled records stream;
// a page survives restarts as one firing episode; and the Grafana dashboard's queries return
// series from the same Prometheus.
//
// The tools are skipped with a message when absent, and required when CFGUARD_REQUIRE_TOOLS=1
// (.ci/run). Package deploy holds the checks of the deployment files themselves.
package alerting
