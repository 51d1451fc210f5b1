// Package bnn is cfguard's model: a mean-field Gaussian Bayesian multi-layer perceptron with
// torchbnn semantics.
//
// Every weight and bias is an independent Gaussian,
//
//	w ~ N(mu, sigma^2),   sigma = exp(log_sigma),
//
// stored as (weight_mu, weight_log_sigma, bias_mu, bias_log_sigma) per layer, exactly as torchbnn's
// BayesLinear names them. Every forward pass draws fresh weights. The default architecture is the
// paper's tabular network D -> 64 -> 32 -> C with ReLU between layers and log-softmax at the end.
// Feature standardisation (x - mean) / std is part of the model, so callers pass raw features.
//
// The package holds the posterior (Model), sampling and the Monte-Carlo posterior predictive
// (Predictive), the model files (Save, Load), and Bayes-by-backprop training (Train). Hot loops are
// plain Go and gonum; gorgonia is used only where gradients are needed.
package bnn
