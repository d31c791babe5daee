/*
 * test_moedc_held — what libmoedclient reads of the experts a daemon holds (LayerInfo.experts_held
 * and adds_shared_experts, moed --experts): the ranges as sent, a daemon older than the fields
 * taken as holding every expert and adding the shared ones, and ranges no moed sends (overlapping,
 * decreasing, past the layer's experts) refused as a malformed reply, so a fleet never plans over
 * them.
 */
#include "check.h"
#include "moedc_codec.h"

#include <moed/v1/moed.pb-c.h>

#include <stdlib.h>
#include <string.h>

/* A ModelInfo of one layer of 8 experts holding ranges r[0 .. n-1] ({first, last} pairs). */
static int decode(const uint32_t (*r)[2], size_t n, bool shared, moedc_model_info *out,
                  moedc_error *err)
{
    Moed__V1__ExpertRange ranges[4], *rp[4];
    for (size_t i = 0; i < n; i++) {
        moed__v1__expert_range__init(&ranges[i]);
        ranges[i].first = r[i][0];
        ranges[i].last = r[i][1];
        rp[i] = &ranges[i];
    }
    Moed__V1__LayerInfo li = MOED__V1__LAYER_INFO__INIT, *lp = &li;
    li.index = 3;
    li.num_experts = 8;
    li.n_experts_held = n;
    li.experts_held = rp;
    li.adds_shared_experts = shared;
    Moed__V1__ModelInfo m = MOED__V1__MODEL_INFO__INIT;
    m.n_layers = 1;
    m.layers = &lp;
    uint8_t buf[512];
    size_t len = moed__v1__model_info__pack(&m, buf);
    return moedc_decode_model_info(buf, len, out, err);
}

int main(void)
{
    moedc_model_info info;
    moedc_error err = { 0 };
    const uint32_t shard[2][2] = { { 1, 3 }, { 6, 6 } };
    CHECK_EQ_INT(decode(shard, 2, false, &info, &err), 0);
    CHECK(info.n_layers == 1 && info.layers[0].n_held == 2 && !info.layers[0].adds_shared);
    CHECK(info.layers[0].held[0].first == 1 && info.layers[0].held[0].last == 3);
    CHECK(info.layers[0].held[1].first == 6 && info.layers[0].held[1].last == 6);
    moedc_model_info_free(&info);

    CHECK_EQ_INT(decode(NULL, 0, false, &info, &err), 0); /* a moed older than the fields */
    CHECK(info.layers[0].n_held == 1 && info.layers[0].adds_shared);
    CHECK(info.layers[0].held[0].first == 0 && info.layers[0].held[0].last == 7);
    moedc_model_info_free(&info);

    const uint32_t bad[][2][2] = { { { 0, 3 }, { 3, 5 } },   /* overlapping */
                                   { { 4, 5 }, { 0, 1 } },   /* decreasing */
                                   { { 2, 1 }, { 4, 4 } },   /* last before first */
                                   { { 0, 3 }, { 6, 8 } } }; /* past the 8 experts */
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_EQ_INT(decode(bad[i], 2, true, &info, &err), MOEDC_EFORMAT);
        CHECK_MSG(strstr(err.msg, "layer 3's experts_held"), "%s", err.msg);
        CHECK(!info.layers && !info.n_layers);
    }
    return check_status("test_moedc_held");
}
