package alerts

import (
	"bytes"
	_ "embed"
)

//go:embed rules.yml
var rulesYML []byte

// Rules returns the Prometheus alerting rules (rules.yml) for the metrics of NewMetrics, for the
// daemon to serve or write next to its state. The caller gets its own copy.
func Rules() []byte { return bytes.Clone(rulesYML) }
