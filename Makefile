# moed: the two commands a newcomer types (README.md), and a few helpers. The work is done by the
# scripts named here, so CI and people run exactly the same steps.
#
#   make demo    install what is missing, build, start moed with a synthetic model, call it from
#                Python and C, print what came back, stop it
#   make test    install what is missing, build, run every test (ctest, then pytest)

BUILD_DIR ?= build
export BUILD_DIR

.PHONY: demo test deps build unit e2e readme-flags clean

demo:
	bash client/demo.sh

test:
	bash tests/run-all.sh

# Helpers: one stage of tests/run-all.sh each.
deps:
	bash tests/run-all.sh deps
build:
	bash tests/run-all.sh build
unit:
	bash tests/run-all.sh unit
e2e:
	bash tests/run-all.sh client e2e

# Rewrites the `moed --help` block that docs/operations.md carries under "Flags" (a test checks it).
readme-flags: build
	.venv/bin/python tests/readme_flags.py $(BUILD_DIR)/server/moed

clean:
	rm -rf $(BUILD_DIR)
