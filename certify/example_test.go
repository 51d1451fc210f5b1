package certify_test

import (
	"fmt"
	"math"

	"github.com/cfguard/cfguard/certify"
)

// One weight moves from N(0, 1) to N(0.1, 0.9^2): KL = ln(1/0.9) + (0.81 + 0.01)/2 - 1/2.
func ExampleKLDiag() {
	kl := certify.KLDiag([]float64{0.1}, []float64{math.Log(0.9)}, []float64{0}, []float64{0})
	fmt.Printf("KL = %.6f (closed form %.6f)\n", kl, math.Log(1/0.9)+(0.81+0.01)/2-0.5)
	// Output: KL = 0.015361 (closed form 0.015361)
}

// The paper's KL budget at delta = 0.05: a CE with p1 >= 0.95 keeps p2 >= 1/2 while
// KL <= (0.5 - 0.05)^2 / 2.
func ExampleKLBudget() {
	b := certify.KLBudget(0.05)
	fmt.Printf("budget %.5f, Theorem 1 at the budget: p2 >= %.4f\n", b, certify.ProbLower(0.95, b, certify.Paper))
	// Output: budget 0.10125, Theorem 1 at the budget: p2 >= 0.5000
}

// Theorem 1 (p2 >= p1 - 2 sqrt(KL/2)) and Theorem 2 (Var2 <= Var1 + 6 sqrt(KL/2)) after an
// update with KL = 0.02, from p1 = 0.97, Var1 = 0.004; the tight mode's TV bound beside them.
func ExampleProbLower() {
	const p1, v1, kl = 0.97, 0.004, 0.02
	fmt.Printf("paper: p2 >= %.4f, Var2 <= %.4f\n", certify.ProbLower(p1, kl, certify.Paper), certify.VarUpper(v1, kl, certify.Paper))
	fmt.Printf("tight: p2 >= %.4f, Var2 <= %.4f\n", certify.ProbLower(p1, kl, certify.Tight), certify.VarUpper(v1, kl, certify.Tight))
	// Output:
	// paper: p2 >= 0.7700, Var2 <= 0.2500
	// tight: p2 >= 0.8700, Var2 <= 0.2500
}

// How much KL each theorem tolerates for one CE: Theorem 1 from its p1, Theorem 2 from its Var1
// up to a variance ceiling of 0.05.
func ExampleKLBudgetForVar() {
	fmt.Printf("Theorem 1 from p1 = 0.99: KL <= %.4f\n", certify.KLBudgetForP1(0.99))
	fmt.Printf("Theorem 2 from Var1 = 0.01 to 0.05: KL <= %.3g\n", certify.KLBudgetForVar(0.01, 0.05))
	// Output:
	// Theorem 1 from p1 = 0.99: KL <= 0.1200
	// Theorem 2 from Var1 = 0.01 to 0.05: KL <= 8.89e-05
}

// A CE is certified while both bounds hold under the policy's variance ceiling.
func ExamplePolicy_Bounds() {
	p := certify.DefaultPolicy()
	c := certify.Certificate{P1: 0.99, Var1: 0.001, Samples: 1000, Delta: 0.05, Epsilon: 0.01}
	for _, kl := range []float64{0, 0.05, 0.2} {
		b := p.Bounds(c, kl)
		fmt.Printf("KL %.2f: p2 >= %.3f, certified %v\n", kl, b.ProbLower, b.Certified)
	}
	// Output:
	// KL 0.00: p2 >= 0.990, certified true
	// KL 0.05: p2 >= 0.674, certified true
	// KL 0.20: p2 >= 0.358, certified false
}
