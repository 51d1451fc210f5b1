// Package bnn is cfguard's model: a mean-field Gaussian Bayesian multi-layer perceptron with
// torchbnn semantics.
//
// Every weight and bias is an independent Gaussian,
//
//	w ~ N(mu, sigma^2),   sigma = exp(log_sigma),
//
// stored as (weight_mu, weight_log_sigma, bias_mu, bias_log_sigma) per layer, exactly as torchbnn's
// BayesLinear names them. A forward pass uses one draw of every weight. The default architecture
// is the paper's tabular network D -> 64 -> 32 -> C with an Activation (ReLU unless the model file
// says tanh or sigmoid) between layers and a softmax at the end. Feature standardisation
// (x - mean) / std is part of the model, so callers pass raw features.
//
// The package holds the posterior (Model), sampling and the Monte-Carlo posterior predictive
// (Predict, PredictWith; Predictive), draws shared across calls for one posterior version (Pool),
// the model files (Save, Load), and Bayes-by-backprop training (Train, Fit, Graph, Adam).
//
// For the paper's comparison it also holds the MC Dropout network (Model.Dropout, FitDropout): a
// deterministic MLP whose draws are dropout masks instead of Gaussian weights, so that the same
// predictive, pools and counterfactual generators average stochastic forward passes.
//
// The predictive's forward passes run in float64 or float32 (Precision; the posterior, the softmax
// and the moments are always float64) through a chunked engine (engine.go) whose matrix products
// are gonum's pure-Go BLAS by default, or OpenBLAS when built with -tags openblas (Backend says
// which). Hot loops are plain Go, gonum and optionally OpenBLAS; gorgonia is used only where
// gradients are needed, and every gorgonia graph (Graph here; explain's counterfactual objective
// and its autoencoders' training losses) is built with GraphBuilder, whose Compile keeps every
// compiled node's hash its own: gorgonia (v0.9.18) takes two nodes with equal 32-bit hashes for one
// when it compiles, and a read node's hash depends on the address it writes to, so that, rarely, a
// graph compiled without that check computed a wrong program.
package bnn
