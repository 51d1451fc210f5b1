package bnn

import "fmt"

// Precision is the floating-point type of the Monte-Carlo forward passes (Predict, Pool). The
// posterior itself (Model) is always float64; so are the sampled weights before rounding, the
// softmax, and the running mean and variance of the predictive.
//
// Float32 rounds the inputs, the sampled weights and every layer's output to float32. How much
// that moves a probability is bounded in TestFloat32WithinDerivedBound: per draw, a layer with n
// inputs adds at most gamma(n+2) (|W| |h| + |b|) to its outputs' error (gamma(n) = n u / (1 - n u),
// u = 2^-24, the standard bound for a float32 dot product plus the rounding of W, b and the
// result), propagated through the next layers by |W| (every activation is 1-Lipschitz), and a
// softmax probability moves by at most half the largest logit error. For the paper's
// architecture that bound is 1.3e-4 to 1.6e-4, two orders of magnitude under the Monte-Carlo
// standard error of a 1000-draw estimate (sqrt(p (1-p) / S) <= 0.016), and the largest
// difference the test measures is 2.3e-8 (go test ./bnn -run TestFloat32WithinDerivedBound -v).
type Precision uint8

// The precisions; the zero value is Float64.
const (
	Float64 Precision = iota
	Float32
)

var precisionNames = [...]string{Float64: "float64", Float32: "float32"}

// String is "float64" or "float32".
func (p Precision) String() string {
	if int(p) < len(precisionNames) {
		return precisionNames[p]
	}
	return fmt.Sprintf("Precision(%d)", uint8(p))
}

// ParsePrecision accepts float64 and float32.
func ParsePrecision(s string) (Precision, error) {
	for p, name := range precisionNames {
		if s == name {
			return Precision(p), nil
		}
	}
	return 0, fmt.Errorf("unknown precision %q (want float64 or float32)", s)
}

// MarshalText encodes the precision by name.
func (p Precision) MarshalText() ([]byte, error) {
	if int(p) >= len(precisionNames) {
		return nil, fmt.Errorf("unknown precision %d", uint8(p))
	}
	return []byte(p.String()), nil
}

// UnmarshalText accepts the names ParsePrecision accepts, so that a YAML or JSON configuration
// can say precision: float32.
func (p *Precision) UnmarshalText(b []byte) error {
	v, err := ParsePrecision(string(b))
	if err != nil {
		return err
	}
	*p = v
	return nil
}
