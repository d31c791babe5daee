/*
 * test_moedc_held — what libmoedclient reads of the experts a daemon holds (LayerInfo.experts_held
 * and adds_shared_experts, moed --experts): the ranges as sent, a daemon older than the fields
 * taken as holding every expert and adding the shared ones, and ranges no moed sends (overlapping,
 * decreasing, past the layer's experts) refused as a malformed reply, so a fleet never plans over
 * them. Likewise where the experts live (home_device, expert_placement): read as sent, refused
 * when out of order or on a device the reply does not list.
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

/* A ModelInfo of one layer of 8 experts on 2 devices, home 1, placed as p[0 .. n-1]
 * ({first, last, device}). */
static int decode_placed(const uint32_t (*p)[3], size_t n, moedc_model_info *out, moedc_error *err)
{
    Moed__V1__ExpertPlacement places[4], *pp[4];
    for (size_t i = 0; i < n; i++) {
        moed__v1__expert_placement__init(&places[i]);
        places[i].first = p[i][0];
        places[i].last = p[i][1];
        places[i].device = p[i][2];
        pp[i] = &places[i];
    }
    Moed__V1__LayerInfo li = MOED__V1__LAYER_INFO__INIT, *lp = &li;
    li.index = 3;
    li.num_experts = 8;
    li.home_device = 1;
    li.n_expert_placement = n;
    li.expert_placement = pp;
    Moed__V1__Device dev[2] = { MOED__V1__DEVICE__INIT, MOED__V1__DEVICE__INIT },
                     *dp[2] = { &dev[0], &dev[1] };
    Moed__V1__ModelInfo m = MOED__V1__MODEL_INFO__INIT;
    m.n_layers = 1;
    m.layers = &lp;
    m.n_devices = 2;
    m.devices = dp;
    uint8_t buf[512];
    size_t len = moed__v1__model_info__pack(&m, buf);
    return moedc_decode_model_info(buf, len, out, err);
}

static void test_placement(void)
{
    moedc_model_info info;
    moedc_error err = { 0 };
    const uint32_t split[2][3] = { { 0, 2, 0 }, { 3, 7, 1 } };
    CHECK_EQ_INT(decode_placed(split, 2, &info, &err), 0);
    CHECK(info.layers[0].home_device == 1 && info.layers[0].n_placed == 2);
    CHECK(info.layers[0].placed[0].first == 0 && info.layers[0].placed[0].last == 2 &&
          info.layers[0].placed[0].device == 0);
    CHECK(info.layers[0].placed[1].first == 3 && info.layers[0].placed[1].last == 7 &&
          info.layers[0].placed[1].device == 1);
    moedc_model_info_free(&info);
    const uint32_t bad[][2][3] = { { { 0, 3, 0 }, { 4, 7, 2 } },   /* a device not listed */
                                   { { 4, 7, 0 }, { 0, 3, 1 } } }; /* decreasing */
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_EQ_INT(decode_placed(bad[i], 2, &info, &err), MOEDC_EFORMAT);
        CHECK_MSG(strstr(err.msg, "expert_placement"), "%s", err.msg);
    }
}

int main(void)
{
    test_placement();
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
