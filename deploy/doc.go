// Package deploy holds no code: it is the home of the tests that keep cfguard's deployment
// files honest (the Dockerfile, deploy/kubernetes, deploy/prometheus, deploy/grafana).
//
// They check the files against the real things they describe, without a Docker engine or a
// cluster: with CFGUARD_IMAGE_BUILDS=1 (.ci/run sets it in a step of its own) the Dockerfile's
// build script is run on exactly the build context .dockerignore lets through, for both targets:
// the static binary must be statically linked, start and pass its health check, and the default
// one must link libopenblas.so.0 from the package its stage installs; the
// Kubernetes manifests are decoded strictly into the Kubernetes API's own Go types (unknown or
// repeated fields are errors, as with the API server's strict field validation) and checked
// against each other and the daemon's configuration; the Prometheus and Alertmanager
// configurations pass promtool and amtool; the Grafana dashboard only queries metrics a running
// daemon serves. The deployment guide, docs/DEPLOY.md, names only files, settings, alerts and
// metrics that exist. The tests that run the shipped Prometheus and Alertmanager against a live
// daemon (alerts that reach Alertmanager after drift, and stay true through learning and
// restarts) are in deploy/internal/tests/alerting.
//
// Tools the tests run (promtool, amtool, file, ldd, gcc and dpkg for the image builds) are
// skipped with a message when absent, and required when CFGUARD_REQUIRE_TOOLS=1 (.ci/run).
package deploy
