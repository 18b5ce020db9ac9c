// The per-element update rule of every optimizer, one functor each, shared by the CPU and CUDA drivers,
// and Q8_RULES, the list of them by name. Each gives the same bits as its rule's update in
// ds_q8/optim/rules.py, one IEEE operation at a time (q8_common.h says how the drivers are compiled).
//
// ---------------------------------------------------------------------------------------------
// Adding an optimizer: docs/adding-an-optimizer.md (AdEMAMixRule below is its worked example)
// ---------------------------------------------------------------------------------------------
// 1. In ds_q8/optim/rules.py, a Rule(name, state_names, state_signed, update): update(p, g, states, h)
//    is the specification, on float32 tensors, one operation per line.
// 2. Here, a functor next to the others:
//      struct MyRule {
//        static constexpr int kStates = 1 to Q8_MAX_STATES; // = len(Rule.state_names)
//        static constexpr unsigned kSigned = ...;           // bit k set: Rule.state_signed[k]
//        float lr, ...;                                 // step scalars, already float
//        template <class Get> Q8_HOST explicit MyRule(Get get)
//            : lr(q8_hyper(get, "lr")), ... {}          // names = keys of the class's _hyper() dict
//        template <class V> Q8_HD void operator()(V& p, V g, V* s) const { ... }
//      };
//    operator() receives the parameter and gradient as float32 and the states dequantized to
//    float32, and updates p and s[0..kStates) in place. V is `float` on CUDA and in the scalar
//    CPU path and a SIMD vector on AVX2/AVX-512; it supports + - * /, V(float) broadcast,
//    q8_sqrt(V) and q8_sign(V). Branch only on hyperparameters (uniform per call), never on
//    element values, so the same code vectorizes. Mirror the rule's update one operation per
//    line: `a * b + c * d` is fine (contraction is off), but do not reassociate.
//    Then one line in Q8_RULES at the end of this file, under the Rule's name.
// 3. In ds_q8/optim/, the class: a subclass of Optimizer8bitBlock (ds_q8/optim/base.py) with
//    `rule = rules.MY_RULE`, its constructor defaults, _check_group and _hyper. The drivers pick the
//    functor up by name; no kernel or binding changes.
// 4. Its row in tests/helpers/optimizer_cases.py (ds_q8 class, 32-bit reference, hyperparameters).
// Rules scaled by whole-parameter norms (LAMB/LARS) get those norms as step scalars.
#pragma once

#include "q8_common.h"

namespace ds_q8 {

// Internal linkage, as in q8_common.h: the driver TUs are compiled for different instruction sets.
namespace {

// ------------------------------------------------------------------ update rules
// Hyperparameters arrive as Python floats (double) and are rounded to float32 once, as torch does
// for a python scalar multiplying a float32 tensor.
template <class Get>
Q8_HOST float q8_hyper(Get& get, const char* name) { return (float)get(name); }

Q8_HD float q8_sqrt(float x) { return sqrtf(x); }

// torch.sign: (0 < x) - (x < 0), so +0, -0 and NaN all give +0.
Q8_HD float q8_sign(float x) { return (0.0f < x ? 1.0f : 0.0f) - (x < 0.0f ? 1.0f : 0.0f); }

// torch.optim.Adam / AdamW (ds_q8.optim.rules.ADAM / ADAMW), states: exp_avg, exp_avg_sq.
template <bool kDecoupled>
struct AdamRule {
    static constexpr int kStates = 2;
    static constexpr unsigned kSigned = 0b01u;
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor, step_size,
        inv_bias_correction2_sqrt;
    bool has_weight_decay;

    template <class Get>
    Q8_HOST explicit AdamRule(Get get)
        : beta1(q8_hyper(get, "beta1")), one_minus_beta1(q8_hyper(get, "one_minus_beta1")),
          beta2(q8_hyper(get, "beta2")), one_minus_beta2(q8_hyper(get, "one_minus_beta2")),
          eps(q8_hyper(get, "eps")), weight_decay(q8_hyper(get, "weight_decay")),
          decay_factor(q8_hyper(get, "decay_factor")), step_size(q8_hyper(get, "step_size")),
          // the reference multiplies by 1 / bias_correction2_sqrt, divided in double then rounded
          inv_bias_correction2_sqrt((float)(1.0 / get("bias_correction2_sqrt"))),
          has_weight_decay(get("weight_decay") != 0.0) {}

    template <class V>
    Q8_HD void operator()(V& p, V g, V* s) const {
        if (has_weight_decay) {
            if (kDecoupled) p = p * V(decay_factor);
            else g = g + p * V(weight_decay);
        }
        V m = s[0] * V(beta1) + g * V(one_minus_beta1);
        V v = s[1] * V(beta2) + (g * g) * V(one_minus_beta2);
        V denom = q8_sqrt(v) * V(inv_bias_correction2_sqrt) + V(eps);
        p = p - (m / denom) * V(step_size);
        s[0] = m;
        s[1] = v;
    }
};

// AdEMAMix (Pagliardini et al., 2024), decoupled weight decay as AdamW; states: m1 (fast EMA), m2 (slow
// EMA), nu (second moment). beta3 and alpha are this step's values, scheduled in Python.
struct AdEMAMixRule {
    static constexpr int kStates = 3;
    static constexpr unsigned kSigned = 0b011u;
    float beta1, one_minus_beta1, beta2, one_minus_beta2, beta3, one_minus_beta3, eps, decay_factor, alpha, lr,
        inv_bias_correction1, inv_bias_correction2_sqrt;
    bool has_weight_decay;

    template <class Get>
    Q8_HOST explicit AdEMAMixRule(Get get)
        : beta1(q8_hyper(get, "beta1")), one_minus_beta1(q8_hyper(get, "one_minus_beta1")),
          beta2(q8_hyper(get, "beta2")), one_minus_beta2(q8_hyper(get, "one_minus_beta2")),
          beta3(q8_hyper(get, "beta3")), one_minus_beta3(q8_hyper(get, "one_minus_beta3")),
          eps(q8_hyper(get, "eps")), decay_factor(q8_hyper(get, "decay_factor")), alpha(q8_hyper(get, "alpha")),
          lr(q8_hyper(get, "lr")),
          // the reference multiplies by python reciprocals, divided in double then rounded
          inv_bias_correction1((float)(1.0 / get("bias_correction1"))),
          inv_bias_correction2_sqrt((float)(1.0 / get("bias_correction2_sqrt"))),
          has_weight_decay(get("weight_decay") != 0.0) {}

    template <class V>
    Q8_HD void operator()(V& p, V g, V* s) const {
        if (has_weight_decay) p = p * V(decay_factor);
        V m1 = s[0] * V(beta1) + g * V(one_minus_beta1);
        V m2 = s[1] * V(beta3) + g * V(one_minus_beta3);
        V nu = s[2] * V(beta2) + (g * g) * V(one_minus_beta2);
        V denom = q8_sqrt(nu) * V(inv_bias_correction2_sqrt) + V(eps);
        V num = m1 * V(inv_bias_correction1) + m2 * V(alpha);
        p = p - (num / denom) * V(lr);
        s[0] = m1;
        s[1] = m2;
        s[2] = nu;
    }
};

// torch.optim.SGD with momentum (ds_q8.optim.momentum.Momentum8bitBlock), state: momentum_buffer.
struct MomentumRule {
    static constexpr int kStates = 1;
    static constexpr unsigned kSigned = 0b1u;
    float lr, momentum, one_minus_dampening, weight_decay;
    bool has_weight_decay, nesterov, first_step;

    template <class Get>
    Q8_HOST explicit MomentumRule(Get get)
        : lr(q8_hyper(get, "lr")), momentum(q8_hyper(get, "momentum")),
          one_minus_dampening(q8_hyper(get, "one_minus_dampening")), weight_decay(q8_hyper(get, "weight_decay")),
          has_weight_decay(get("weight_decay") != 0.0), nesterov(get("nesterov") != 0.0),
          first_step(get("first_step") != 0.0) {}

    template <class V>
    Q8_HD void operator()(V& p, V g, V* s) const {
        if (has_weight_decay) g = g + p * V(weight_decay);
        V buf = first_step ? g : s[0] * V(momentum) + g * V(one_minus_dampening);
        V d = nesterov ? g + buf * V(momentum) : buf;
        p = p - d * V(lr);
        s[0] = buf;
    }
};

// torch.optim.RMSprop, not centered (ds_q8.optim.rmsprop.RMSprop8bitBlock), states: square_avg and,
// with momentum, momentum_buffer. The state layout is fixed per optimizer, hence two rules.
template <bool kMomentum>
struct RMSpropRule {
    static constexpr int kStates = kMomentum ? 2 : 1;
    static constexpr unsigned kSigned = kMomentum ? 0b10u : 0b0u;
    float lr, alpha, one_minus_alpha, eps, weight_decay, momentum;
    bool has_weight_decay;

    template <class Get>
    Q8_HOST explicit RMSpropRule(Get get)
        : lr(q8_hyper(get, "lr")), alpha(q8_hyper(get, "alpha")), one_minus_alpha(q8_hyper(get, "one_minus_alpha")),
          eps(q8_hyper(get, "eps")), weight_decay(q8_hyper(get, "weight_decay")),
          momentum(q8_hyper(get, "momentum")), has_weight_decay(get("weight_decay") != 0.0) {}

    template <class V>
    Q8_HD void operator()(V& p, V g, V* s) const {
        if (has_weight_decay) g = g + p * V(weight_decay);
        V sq = s[0] * V(alpha) + (g * g) * V(one_minus_alpha);
        V avg = q8_sqrt(sq) + V(eps);
        V d = g / avg;
        s[0] = sq;
        if (kMomentum) {
            // s[kStates - 1] is s[1] here; spelled so the one-state instantiation never names s[1]
            V buf = s[kStates - 1] * V(momentum) + d;
            s[kStates - 1] = buf;
            d = buf;
        }
        p = p - d * V(lr);
    }
};

// torch.optim.Adagrad (ds_q8.optim.adagrad.Adagrad8bitBlock), state: sum. clr is the decayed lr.
struct AdagradRule {
    static constexpr int kStates = 1;
    static constexpr unsigned kSigned = 0b0u;
    float clr, weight_decay, eps;
    bool has_weight_decay;

    template <class Get>
    Q8_HOST explicit AdagradRule(Get get)
        : clr(q8_hyper(get, "clr")), weight_decay(q8_hyper(get, "weight_decay")), eps(q8_hyper(get, "eps")),
          has_weight_decay(get("weight_decay") != 0.0) {}

    template <class V>
    Q8_HD void operator()(V& p, V g, V* s) const {
        if (has_weight_decay) g = g + p * V(weight_decay);
        V sum = s[0] + g * g;
        V std = q8_sqrt(sum) + V(eps);
        p = p - (g / std) * V(clr);
        s[0] = sum;
    }
};

// LAMB (ds_q8.optim.lamb.LAMB8bitBlock), states: exp_avg, exp_avg_sq. The trust ratio comes from
// the first (norm) pass in Python, folded into step_size = lr * trust.
struct LambRule {
    static constexpr int kStates = 2;
    static constexpr unsigned kSigned = 0b01u;
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, step_size, inv_bias_correction1,
        inv_bias_correction2_sqrt;
    bool has_weight_decay;

    template <class Get>
    Q8_HOST explicit LambRule(Get get)
        : beta1(q8_hyper(get, "beta1")), one_minus_beta1(q8_hyper(get, "one_minus_beta1")),
          beta2(q8_hyper(get, "beta2")), one_minus_beta2(q8_hyper(get, "one_minus_beta2")),
          eps(q8_hyper(get, "eps")), weight_decay(q8_hyper(get, "weight_decay")),
          step_size(q8_hyper(get, "step_size")),
          // the reference multiplies by python reciprocals, divided in double then rounded
          inv_bias_correction1((float)(1.0 / get("bias_correction1"))),
          inv_bias_correction2_sqrt((float)(1.0 / get("bias_correction2_sqrt"))),
          has_weight_decay(get("weight_decay") != 0.0) {}

    template <class V>
    Q8_HD void operator()(V& p, V g, V* s) const {
        V m = s[0] * V(beta1) + g * V(one_minus_beta1);
        V v = s[1] * V(beta2) + (g * g) * V(one_minus_beta2);
        V denom = q8_sqrt(v) * V(inv_bias_correction2_sqrt) + V(eps);
        V u = (m * V(inv_bias_correction1)) / denom;
        if (has_weight_decay) u = u + p * V(weight_decay);
        p = p - u * V(step_size);
        s[0] = m;
        s[1] = v;
    }
};

// LARS (ds_q8.optim.lars.LARS8bitBlock), state: momentum_buffer; trust_ratio from the norm pass.
struct LarsRule {
    static constexpr int kStates = 1;
    static constexpr unsigned kSigned = 0b1u;
    float lr, momentum, weight_decay, trust_ratio;
    bool has_weight_decay;

    template <class Get>
    Q8_HOST explicit LarsRule(Get get)
        : lr(q8_hyper(get, "lr")), momentum(q8_hyper(get, "momentum")), weight_decay(q8_hyper(get, "weight_decay")),
          trust_ratio(q8_hyper(get, "trust_ratio")), has_weight_decay(get("weight_decay") != 0.0) {}

    template <class V>
    Q8_HD void operator()(V& p, V g, V* s) const {
        if (has_weight_decay) g = g + p * V(weight_decay);
        V buf = s[0] * V(momentum) + g * V(trust_ratio);
        p = p - buf * V(lr);
        s[0] = buf;
    }
};

// Lion (ds_q8.optim.lion.Lion8bitBlock), state: exp_avg.
struct LionRule {
    static constexpr int kStates = 1;
    static constexpr unsigned kSigned = 0b1u;
    float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay_factor;
    bool has_weight_decay;

    template <class Get>
    Q8_HOST explicit LionRule(Get get)
        : lr(q8_hyper(get, "lr")), beta1(q8_hyper(get, "beta1")), one_minus_beta1(q8_hyper(get, "one_minus_beta1")),
          beta2(q8_hyper(get, "beta2")), one_minus_beta2(q8_hyper(get, "one_minus_beta2")),
          decay_factor(q8_hyper(get, "decay_factor")), has_weight_decay(get("weight_decay") != 0.0) {}

    template <class V>
    Q8_HD void operator()(V& p, V g, V* s) const {
        if (has_weight_decay) p = p * V(decay_factor);
        V c = s[0] * V(beta1) + g * V(one_minus_beta1);
        p = p - q8_sign(c) * V(lr);
        s[0] = s[0] * V(beta2) + g * V(one_minus_beta2);
    }
};

}  // namespace

// Every rule the drivers know, by its Python Rule's name (ds_q8/optim/rules.py).
#define Q8_RULES(X)                             \
    X("adam", AdamRule<false>)                  \
    X("adamw", AdamRule<true>)                  \
    X("momentum", MomentumRule)                 \
    X("rmsprop", RMSpropRule<false>)            \
    X("rmsprop_momentum", RMSpropRule<true>)    \
    X("adagrad", AdagradRule)                   \
    X("lamb", LambRule)                         \
    X("lars", LarsRule)                         \
    X("lion", LionRule)                         \
    X("ademamix", AdEMAMixRule)

}  // namespace ds_q8
