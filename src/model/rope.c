// RoPE inverse frequencies for every scaling kind of struct rope_config, computed once on the
// host in double precision (model.h: model_rope_inv_freq); the backend only sees inv_freq and
// the cos/sin attention factor.
#include <math.h>

#include "model/model.h"

static float rope_yarn_mscale(float scale, float m) {
    if (scale <= 1.0f) return 1.0f;
    return 0.1f * m * logf(scale) + 1.0f;
}

static double rope_yarn_correction_dim(double num_rotations, int dim, double base, double max_pos) {
    return (dim * log(max_pos / (num_rotations * 2.0 * M_PI))) / (2.0 * log(base));
}

void model_rope_inv_freq(const struct model_config *cfg, int rotary_dim, float *inv_freq, float *attn_factor) {
    const struct rope_config *r = &cfg->rope;
    double base = r->theta > 0 ? r->theta : 10000.0;
    int half = rotary_dim / 2;
    *attn_factor = 1.0f;
    for (int i = 0; i < half; i++) inv_freq[i] = (float)(1.0 / pow(base, (2.0 * i) / rotary_dim));
    double factor = r->factor > 0 ? r->factor : 1.0;
    switch (r->scaling) {
    case ROPE_SCALING_NONE:
    case ROPE_SCALING_DYNAMIC: // dynamic NTK is applied as the unscaled frequencies (as vLLM's default)
        break;
    case ROPE_SCALING_LINEAR:
        for (int i = 0; i < half; i++) inv_freq[i] = (float)(inv_freq[i] / factor);
        break;
    case ROPE_SCALING_LLAMA3: {
        double orig = r->original_max_position > 0 ? r->original_max_position : 8192;
        double lo = r->low_freq_factor > 0 ? r->low_freq_factor : 1.0;
        double hi = r->high_freq_factor > 0 ? r->high_freq_factor : 4.0;
        double low_wavelen = orig / lo, high_wavelen = orig / hi;
        for (int i = 0; i < half; i++) {
            double f = 1.0 / pow(base, (2.0 * i) / rotary_dim);
            double wavelen = 2.0 * M_PI / f;
            if (wavelen < high_wavelen) {
                inv_freq[i] = (float)f;
            } else if (wavelen > low_wavelen) {
                inv_freq[i] = (float)(f / factor);
            } else {
                double smooth = (orig / wavelen - lo) / (hi - lo);
                inv_freq[i] = (float)((1.0 - smooth) * f / factor + smooth * f);
            }
        }
        break;
    }
    case ROPE_SCALING_YARN: {
        double orig = r->original_max_position > 0 ? r->original_max_position : cfg->max_position_embeddings;
        double beta_fast = r->beta_fast > 0 ? r->beta_fast : 32.0, beta_slow = r->beta_slow > 0 ? r->beta_slow : 1.0;
        double low = rope_yarn_correction_dim(beta_fast, rotary_dim, base, orig);
        double high = rope_yarn_correction_dim(beta_slow, rotary_dim, base, orig);
        if (r->yarn_truncate) {
            low = floor(low);
            high = ceil(high);
        }
        if (low < 0) low = 0;
        if (high > rotary_dim - 1) high = rotary_dim - 1;
        if (low == high) high += 0.001;
        for (int i = 0; i < half; i++) {
            double pos_freq = pow(base, (2.0 * i) / rotary_dim);
            double extrap = 1.0 / pos_freq, interp = 1.0 / (factor * pos_freq);
            double ramp = (i - low) / (high - low);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            double extrap_factor = 1.0 - ramp;
            inv_freq[i] = (float)(interp * (1.0 - extrap_factor) + extrap * extrap_factor);
        }
        if (r->attention_factor > 0)
            *attn_factor = r->attention_factor;
        else if (r->mscale > 0 && r->mscale_all_dim > 0)
            *attn_factor = rope_yarn_mscale((float)factor, r->mscale) / rope_yarn_mscale((float)factor, r->mscale_all_dim);
        else
            *attn_factor = rope_yarn_mscale((float)factor, 1.0f);
        break;
    }
    }
}

