package alerts

import (
	"bytes"
	_ "embed"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"go.yaml.in/yaml/v3"
)

//go:embed rules.yml
var rulesYML []byte

// Rules returns the Prometheus alerting rules (rules.yml) for the metrics of this package, as
// shipped in the repository for Prometheus' rule_files (deploy/prometheus); the tests check each
// rule's metrics against what the daemon registers. The caller gets its own copy.
func Rules() []byte { return bytes.Clone(rulesYML) }

var metricRef = regexp.MustCompile(`\bcfguard_[a-zA-Z0-9_]+`)

// RuleMetrics returns, for each alert of Rules, the cfguard_ metric names its expression
// queries (a histogram's series, _bucket, _sum or _count, by the histogram's name), in order of
// first use; an alert that queries none maps to an empty list.
func RuleMetrics() (map[string][]string, error) {
	var file struct {
		Groups []struct {
			Rules []struct {
				Alert string `yaml:"alert"`
				Expr  string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(rulesYML, &file); err != nil {
		return nil, fmt.Errorf("alerts: rules.yml: %w", err)
	}
	out := map[string][]string{}
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			seen := map[string]bool{}
			refs := []string{}
			for _, ref := range metricRef.FindAllString(r.Expr, -1) {
				ref = family(ref)
				if !seen[ref] {
					seen[ref] = true
					refs = append(refs, ref)
				}
			}
			out[r.Alert] = refs
		}
	}
	return out, nil
}

// family is the metric a series name belongs to: a histogram's series (_bucket, _sum, _count)
// belong to the histogram.
func family(series string) string {
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(series, suffix); ok && slices.Contains(Names(), base) {
			return base
		}
	}
	return series
}
