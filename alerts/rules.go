package alerts

import (
	"bytes"
	_ "embed"
)

//go:embed rules.yml
var rulesYML []byte

// Rules returns the Prometheus alerting rules (rules.yml) for the metrics of NewMetrics, as
// shipped in the repository for Prometheus' rule_files (deploy/prometheus); the tests check each
// rule's metrics against NewMetrics. The caller gets its own copy.
func Rules() []byte { return bytes.Clone(rulesYML) }
