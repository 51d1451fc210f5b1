package bnn

import (
	"fmt"
	"math"
)

// Activation is the non-linearity applied after every hidden layer. The output layer is always
// a softmax over its logits.
type Activation uint8

// The supported activations; the zero value is ReLU, torchbnn's and the paper's.
const (
	ReLU    Activation = iota // relu(x) = max(x, 0)
	Tanh                      // tanh(x)
	Sigmoid                   // sigmoid(x) = 1 / (1 + exp(-x))
)

var activationNames = [...]string{ReLU: "relu", Tanh: "tanh", Sigmoid: "sigmoid"}

// String is the activation's name as model.json spells it: relu, tanh or sigmoid.
func (a Activation) String() string {
	if int(a) < len(activationNames) {
		return activationNames[a]
	}
	return fmt.Sprintf("Activation(%d)", uint8(a))
}

// valid reports whether a is one of the supported activations.
func (a Activation) valid() bool { return int(a) < len(activationNames) }

// ParseActivation accepts relu, tanh and sigmoid.
func ParseActivation(s string) (Activation, error) {
	for a, name := range activationNames {
		if s == name {
			return Activation(a), nil
		}
	}
	return 0, fmt.Errorf("unknown activation %q (want relu, tanh or sigmoid)", s)
}

// MarshalText encodes the activation by name.
func (a Activation) MarshalText() ([]byte, error) {
	if !a.valid() {
		return nil, fmt.Errorf("unknown activation %d", uint8(a))
	}
	return []byte(a.String()), nil
}

// UnmarshalText accepts the names ParseActivation accepts.
func (a *Activation) UnmarshalText(b []byte) error {
	v, err := ParseActivation(string(b))
	if err != nil {
		return err
	}
	*a = v
	return nil
}

// Apply returns a(x). NaN stays NaN for every activation.
func (a Activation) Apply(x float64) float64 {
	switch a {
	case Tanh:
		return math.Tanh(x)
	case Sigmoid:
		return sigmoid(x)
	}
	return max(x, 0) // max propagates NaN
}

// sigmoid is 1 / (1 + exp(-x)), which is 0 (not NaN) when exp(-x) overflows.
func sigmoid(x float64) float64 { return 1 / (1 + math.Exp(-x)) }
